"""What travels on the bus: the envelope every message is wrapped in, the typed event
bodies (msgspec Structs, one decoder per kind, every network number bounded), and the
snapshot records a compactor folds a source's events into. No I/O, no asyncio.
Module map: README.md in this folder."""
