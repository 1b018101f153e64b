# The postbox relay. Build: docker build -t postbox . ; run: docker run postbox (= postbox run).
#
# Stages: `build` compiles the relay; `runtime` is what it runs on (libpq, CA certificates, a
# non-root user); the last stage, the default, puts the built binary on the runtime. `prebuilt`
# puts a binary built elsewhere on the same runtime: CI builds it from a context holding only that
# binary (scripts/check-image.sh), on a base made from Debian's packages:
#   podman build --target prebuilt --build-arg RUNTIME_BASE=<base> -f Dockerfile <dir with postbox>
ARG RUNTIME_BASE=debian:bookworm-slim

FROM rust:1-bookworm AS build
WORKDIR /src
# librdkafka is compiled from source by rdkafka-sys; libpq for diesel's sync connection.
RUN apt-get update && apt-get install -y --no-install-recommends libpq-dev build-essential && rm -rf /var/lib/apt/lists/*
COPY Cargo.toml Cargo.lock diesel.toml ./
COPY src src
COPY migrations migrations
RUN cargo build --release --locked --bin postbox

FROM ${RUNTIME_BASE} AS runtime
RUN apt-get update && apt-get install -y --no-install-recommends libpq5 ca-certificates \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && echo 'postbox:x:10001:10001:postbox relay:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
    && echo 'postbox:x:10001:' >> /etc/group
USER 10001:10001
EXPOSE 9464
ENTRYPOINT ["postbox"]
CMD ["run"]

FROM runtime AS prebuilt
COPY postbox /usr/local/bin/postbox

FROM runtime
COPY --from=build /src/target/release/postbox /usr/local/bin/postbox
