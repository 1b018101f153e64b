#!/usr/bin/env bash
# The chart's PrometheusRule, rendered for a release named "postbox" with the default thresholds:
# `promtool check rules` lints it and `promtool test rules` runs tests/alerts/postbox.test.yaml
# (each alert firing and not firing on input series). Needs helm (scripts/check-helm.sh fetches
# it into target/tools) and promtool (Debian package `prometheus`).
set -euo pipefail
cd "$(dirname "$0")/.."
helm="${HELM:-target/tools/helm}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$helm" template postbox helm/postbox --set prometheusRule.enabled=true --set database.existingSecret=postbox-database \
  --show-only templates/prometheusrule.yaml > "$work/rendered.yaml"
python3 - "$work/rendered.yaml" "$work/postbox-rules.yaml" <<'PY'
import sys, yaml
rule = yaml.safe_load(open(sys.argv[1]))
assert rule["kind"] == "PrometheusRule", rule["kind"]
yaml.safe_dump({"groups": rule["spec"]["groups"]}, open(sys.argv[2], "w"), sort_keys=False)
PY
cp tests/alerts/postbox.test.yaml "$work/"
promtool check rules "$work/postbox-rules.yaml"
promtool test rules "$work/postbox.test.yaml"
