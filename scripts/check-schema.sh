#!/usr/bin/env bash
# src/schema.rs must be exactly what `diesel print-schema` generates from the migrations.
set -euo pipefail
cd "$(dirname "$0")/.."
server="${POSTBOX_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432}"
db="postbox_schema_check_$$"
url="$server/$db"
committed=$(mktemp)
generated=$(mktemp)
cp src/schema.rs "$committed"
# `diesel migration run` rewrites src/schema.rs itself (diesel.toml): compare against the copy.
trap 'cp "$committed" src/schema.rs; psql "$server/postgres" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true' EXIT
psql "$server/postgres" -qc "CREATE DATABASE $db"
diesel migration run --database-url "$url" >/dev/null
diesel print-schema --database-url "$url" > "$generated"
if ! diff -u "$committed" "$generated"; then
  echo "src/schema.rs is stale: run 'diesel print-schema > src/schema.rs' against a migrated database" >&2
  exit 1
fi
echo "schema.rs matches"
