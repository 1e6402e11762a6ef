"""`kvbus router`: the OpenAI-compatible HTTP service in front of vLLM engines. It
tokenizes as the served model does, asks `kvbus.routing` for a worker, forwards, and
follows the bus (or, while the bus is down, the engines' own /metrics).
Module map: README.md in this folder."""
