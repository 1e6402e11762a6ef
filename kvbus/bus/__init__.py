"""Delivery: the publisher (never blocks its caller), the sans-I/O sequencer that
decides every ordering guarantee, the async subscription that drives it over a
transport, and the helpers that end, retry and follow a stream. Imports the messages
(`kvbus.wire`) and the transports, nothing above. Module map: README.md in this folder."""
