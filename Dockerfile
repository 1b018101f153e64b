# The postbox relay. Build: docker build -t postbox . ; run: docker run postbox (= postbox run).
FROM rust:1-bookworm AS build
WORKDIR /src
# librdkafka is compiled from source by rdkafka-sys; libpq for diesel's sync connection.
RUN apt-get update && apt-get install -y --no-install-recommends libpq-dev build-essential && rm -rf /var/lib/apt/lists/*
COPY Cargo.toml Cargo.lock diesel.toml ./
COPY src src
COPY migrations migrations
RUN cargo build --release --locked --bin postbox

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends libpq5 ca-certificates && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin postbox
COPY --from=build /src/target/release/postbox /usr/local/bin/postbox
USER 10001:10001
EXPOSE 9464
ENTRYPOINT ["postbox"]
CMD ["run"]
