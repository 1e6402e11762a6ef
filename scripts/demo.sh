#!/usr/bin/env bash
# The main job (README): installs vLLM's CPU build and kvbus with the router, then runs
# examples/router_demo.py: an embedded nats-server, two vLLM CPU servers with the kvbus
# plugins, the KV-aware router, and one workload per routing policy, compared in a table
# beside the peer routers (sglang-router, vllm-router) on the same engines; then the
# scenarios where they differ, on kvbus sim fleets (bench/bench_fleet_routing.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh demo
# The peers' rows: prebuilt wheels, in a venv of their own; without them, kvbus's rows only.
bash scripts/install.sh peers || echo "peer routers did not install: their rows are skipped" >&2
.venv/bin/python examples/router_demo.py "$@"
# Where routers differ: fleets of simulated engines (kvbus sim: vLLM's own scheduler and
# prefix cache, H100-class step times), one engine restarted and one reset mid-run (c),
# and three router replicas behind one balancer (d), through the same routers.
exec .venv/bin/python bench/bench_fleet_routing.py --quick --scenarios c,d
