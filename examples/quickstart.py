"""Publish a few KV-event batches and read them back with kvbus.subscribe().

KVBUS_URL=memory:// python examples/quickstart.py
"""

import asyncio
import time

import kvbus
from kvbus import BlockStored, KVEventBatch


async def main() -> None:
    # An engine would call publish() from its scheduler thread; it never blocks.
    with kvbus.Publisher(source="engine-a") as publisher:
        for step in range(3):
            tokens = list(range(step * 16, step * 16 + 16))
            publisher.publish(
                KVEventBatch(
                    time.time(), [BlockStored([step], None, tokens, 16, None, "GPU", None)]
                )
            )
    async with kvbus.subscribe(follow=False) as subscription:
        async for item in subscription:
            if isinstance(item, kvbus.Resync):
                print("reset state of", item.source, "because", item.reason.value)
            else:
                print(item.source, item.epoch, item.seq, item.kind.name, item.body)
        print("resume later from", subscription.cursor.to_bytes().decode())


if __name__ == "__main__":
    asyncio.run(main())
