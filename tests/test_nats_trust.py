"""nats://: the subject authenticates the publisher (real nats-server)."""

from __future__ import annotations

import nats

import kvbus

from .conftest import envelope, kv_payload, seqs
from .servers import NatsServer


async def test_a_client_on_another_subject_cannot_speak_for_a_source(
    nats_server: NatsServer,
) -> None:
    """A client allowed to publish only on ``kvbus.<stream>.evil`` used to be able to
    claim ``source=engine-a``, and to send ``Nats-Msg-Id engine-a:E:S`` ahead of the
    real packs so that JetStream silently dropped them."""
    publisher = kvbus.Publisher(nats_server.url, stream="trust", source="engine-a", max_batch=1)
    publisher.publish(kv_payload(0))
    assert publisher.flush()
    epoch = publisher.epoch
    client = await nats.connect(nats_server.url)
    js = client.jetstream()
    # The next packs' ids as the publisher used to make them, and a forged envelope.
    for seq in range(3, 23):
        await js.publish(
            "kvbus.trust.evil", b"junk", headers={"Nats-Msg-Id": f"engine-a:{epoch}:{seq}+1"}
        )
    await js.publish("kvbus.trust.evil", envelope("engine-a", epoch, 3, kv_payload(666)))
    for i in range(1, 21):
        publisher.publish(kv_payload(i))
        assert publisher.flush()
    sub = kvbus.subscribe("trust", nats_server.url, follow=False)
    items = [i async for i in sub]
    assert seqs(items, "engine-a") == list(range(1, 23))
    assert sub.stats.forged == 1
    await client.close()
    await publisher.aclose()
