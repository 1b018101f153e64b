#!/usr/bin/env bash
# Provides the Kafka clients no one here wrote, for tests/formats.rs: Python's confluent-kafka and
# the CloudEvents SDK (in a virtualenv) and the npm kafkajs consumer, under target/tools/clients.
# Prints that directory.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/tools/clients
mkdir -p "$dir"
if [ ! -x "$dir/venv/bin/python" ] || ! "$dir/venv/bin/python" -c 'import confluent_kafka, cloudevents.core.bindings.kafka' 2>/dev/null; then
  python3 -m venv "$dir/venv" >&2
  "$dir/venv/bin/pip" install --quiet --disable-pip-version-check \
    'confluent-kafka==2.16.1' 'cloudevents==2.2.0' >&2
fi
if [ ! -f "$dir/node_modules/kafkajs/package.json" ]; then
  npm install --silent --no-audit --no-fund --prefix "$dir" 'kafkajs@2.2.4' >&2
fi
realpath "$dir"
