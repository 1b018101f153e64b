#!/usr/bin/env bash
# Builds the relay's container image the way the Dockerfile's runtime stage defines it, around the
# binary the tests built, and runs it the way the chart does (read-only root filesystem, user
# 10001, host network to reach PostgreSQL): `migrate`, `enqueue`, `run --drain` on a few messages,
# and `run` answering /healthz and /readyz. A library missing from the image or a write to the root
# filesystem fails here.
#
# No registry is needed: the base image is made from Debian's packages with debootstrap (from the
# apt mirror this machine is configured with) and imported into podman (vfs storage, runc).
set -euo pipefail
cd "$(dirname "$0")/.."
work=target/image
podman=(podman --storage-driver vfs --runtime runc --cgroup-manager cgroupfs --events-backend file)
base=localhost/debian:bookworm-base
image=localhost/postbox:ci

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
missing=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! "${podman[@]}" image exists "$base"; then
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list)
  rm -rf "$work/rootfs"
  mkdir -p "$work"
  as_root debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >/dev/null
  as_root tar -C "$work/rootfs" -c . | "${podman[@]}" import - "$base" >/dev/null 2>&1
  as_root rm -rf "$work/rootfs"
fi

# The binary the tests built (all features): no second build of the crate.
cargo build --quiet --bin postbox --all-features
rm -rf "$work/context"
mkdir -p "$work/context"
cp target/debug/postbox "$work/context/postbox"
"${podman[@]}" build --quiet --network host --target prebuilt --build-arg RUNTIME_BASE="$base" \
  -t "$image" -f Dockerfile "$work/context" >/dev/null
echo "image built: $("${podman[@]}" image inspect --format '{{.Size}}' "$image") bytes"

db=postbox_image_smoke
url=postgres://postgres@127.0.0.1:5432/$db
psql -h 127.0.0.1 -U postgres -d postgres -qc "DROP DATABASE IF EXISTS $db" >/dev/null
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
run() {
  "${podman[@]}" run --rm --network host --read-only --user 10001:10001 \
    --ulimit nofile=20000:20000 --ulimit nproc=4096:4096 \
    -e POSTBOX_METRICS_LISTEN=127.0.0.1:$port "$@"
}
run "$image" --database-url "$url" migrate
for i in 1 2 3; do
  run "$image" --database-url "$url" enqueue --topic image.smoke --payload "{\"n\": $i}" >/dev/null
done
out=$(run "$image" --database-url "$url" run --drain)
[ "$(grep -c '"topic":"image.smoke"' <<<"$out")" = 3 ] || { echo "run --drain did not relay 3 messages:" >&2; echo "$out" >&2; exit 1; }
echo "run --drain: 3 messages relayed"

name=postbox-image-smoke-$$
run -d --name "$name" "$image" --database-url "$url" run >/dev/null
trap '"${podman[@]}" rm -f "$name" >/dev/null 2>&1 || true' EXIT
for path in /healthz /readyz; do
  ok=""
  for _ in $(seq 1 100); do
    if python3 -c "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:$port$path', timeout=1).status == 200 else 1)" 2>/dev/null; then
      ok=1; break
    fi
    sleep 0.1
  done
  [ -n "$ok" ] || { echo "$path never answered 200" >&2; "${podman[@]}" logs "$name" >&2; exit 1; }
  echo "$path: 200"
done
"${podman[@]}" stop -t 10 "$name" >/dev/null
psql -h 127.0.0.1 -U postgres -d postgres -qc "DROP DATABASE IF EXISTS $db" >/dev/null
echo "image smoke test: ok"
