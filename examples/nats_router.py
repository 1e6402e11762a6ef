"""A KV- and load-aware OpenAI-compatible router in front of vLLM servers, on NATS.

The router itself is the package's service (`kvbus.service.gateway`, also ``kvbus router``);
this launcher is the entry point the docs show. Each vLLM server runs with the kvbus
plugin and stat logger and ``KVBUS_URL`` pointing at the same bus::

    KVBUS_URL=nats://127.0.0.1:4222 KVBUS_SOURCE=a vllm serve MODEL ...  # each server
    KVBUS_URL=nats://127.0.0.1:4222 python examples/nats_router.py --port 8000 \\
        --worker a=http://127.0.0.1:8001 --worker b=http://127.0.0.1:8002 --policy kv

``--help`` lists the options (the same as ``kvbus router``).
"""

from __future__ import annotations

import sys

from kvbus.service.gateway import main

if __name__ == "__main__":
    sys.exit(main())
