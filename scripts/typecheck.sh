#!/usr/bin/env bash
# mypy (strict on kvbus) over the package as it installs: transports/ and connectors/
# become kvbus.transports and kvbus.connectors through symlinks in a temporary view,
# because mypy cannot follow setuptools' editable-install import hook.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
view=$(mktemp -d)
trap 'rm -rf "$view"' EXIT
mkdir "$view/kvbus"
for f in "$root"/kvbus/*; do ln -s "$f" "$view/kvbus/"; done
ln -s "$root/transports" "$view/kvbus/transports"
ln -s "$root/connectors" "$view/kvbus/connectors"
cd "$root"
python -m mypy --config-file "$root/pyproject.toml" "$view/kvbus"
