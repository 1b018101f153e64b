#!/usr/bin/env bash
# Makes sure a PostgreSQL server answers on 127.0.0.1:5432 with trust auth for user postgres:
# starts the local cluster if it is stopped, installs it from Debian's packages if absent.
set -euo pipefail

ready() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
can_login() { psql -h 127.0.0.1 -U postgres -d postgres -Atqc 'select 1' >/dev/null 2>&1; }

if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql postgresql-client >/dev/null
fi

version=$(ls /etc/postgresql | sort -V | tail -n 1)
if ! ready; then
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 60); do ready && break; sleep 0.5; done
fi

if ! can_login; then
  # A fresh Debian cluster asks for passwords over TCP: the tests expect trust on loopback.
  hba="/etc/postgresql/$version/main/pg_hba.conf"
  sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
  sed -i -E 's/^(local\s+all\s+postgres\s+)\S+/\1trust/' "$hba"
  pg_ctlcluster --skip-systemctl-redirect "$version" main reload
  for _ in $(seq 1 60); do can_login && break; sleep 0.5; done
fi

can_login || { echo "PostgreSQL is not reachable as postgres@127.0.0.1:5432" >&2; exit 1; }

# The TLS tests need ssl = on (Debian's default cluster has it, with a certificate for localhost).
if [ "$(psql -h 127.0.0.1 -U postgres -d postgres -Atqc 'show ssl')" != "on" ]; then
  if [ ! -f /etc/ssl/private/ssl-cert-snakeoil.key ]; then
    command -v make-ssl-cert >/dev/null 2>&1 || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ssl-cert >/dev/null; }
    make-ssl-cert generate-default-snakeoil --force-overwrite
  fi
  psql -h 127.0.0.1 -U postgres -d postgres -qc "ALTER SYSTEM SET ssl_cert_file = '/etc/ssl/certs/ssl-cert-snakeoil.pem'" \
    -c "ALTER SYSTEM SET ssl_key_file = '/etc/ssl/private/ssl-cert-snakeoil.key'" -c "ALTER SYSTEM SET ssl = on"
  pg_ctlcluster --skip-systemctl-redirect "$version" main reload
fi
psql -h 127.0.0.1 -U postgres -d postgres -Atqc 'select version()'
