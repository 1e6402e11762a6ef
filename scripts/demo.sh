#!/usr/bin/env bash
# The main job (README): installs vLLM's CPU build and kvbus with the router, then runs
# examples/router_demo.py: an embedded nats-server, two vLLM CPU servers with the kvbus
# plugins, the KV-aware router, and one workload per routing policy, compared in a table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh demo
exec .venv/bin/python examples/router_demo.py "$@"
