"""`kvbus sim`: simulated vLLM engines built on vLLM's own scheduler and block pool,
with a timing model in place of the model (see ``README.md`` in this folder)."""
