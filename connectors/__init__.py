"""Adapters between vLLM and kvbus (event publisher plugin, stat logger, ZMQ bridge).

They import vLLM, so nothing here is imported by ``import kvbus``.
"""
