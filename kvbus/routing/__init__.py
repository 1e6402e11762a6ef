"""Routing, without HTTP: the prefix index rebuilt from KV events (its per-block loops in
C beside their Python reference), each worker's load and freshness, the cost model that
picks a worker and explains why, and the requests other router replicas announced.
Module map: README.md in this folder."""
