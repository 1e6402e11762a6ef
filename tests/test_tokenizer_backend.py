"""The router's tokenizer reads prompts straight from the Rust backend only where that
gives the ids the transformers tokenizer (and so vLLM's server) gives: on the word-level
tokenizer of the tests' model, on a byte-level BPE with a BOS template, and never on a
tokenizer that adds steps of its own in Python."""

from __future__ import annotations

from typing import Any

import pytest
from cluster import make_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbus.service.served_model import Tokenizer, _same_backend


@pytest.fixture(scope="module")
def word_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("word-level")
    make_model(directory)
    return Tokenizer(str(directory))


@pytest.fixture(scope="module")
def byte_level_bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A GPT-2-style byte-level BPE, trained here (no model hub), adding ``<s>`` first."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    corpus = [
        "The quick brown fox jumps over the lazy dog. " * 3,
        "Routing requests to the engine that holds their prefix saves prefill time.",
        "naïve café — 世界 🙂 3.14159 42 it's they're   spaces\n\ttabs",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rust.train_from_iterator(corpus, trainer)
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", rust.token_to_id("<s>"))]
    )
    directory = tmp_path_factory.mktemp("byte-level-bpe")
    PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(directory)
    return Tokenizer(str(directory))


TEXTS = [
    "",
    " ",
    "w3 w4 w1023",
    "w3  w4\n\nw5\t w6 ",
    "<s> w3 </s> <unk>",
    "The quick brown fox, naïve café — 世界 🙂",
    "x" * 5000,
    " ".join(f"w{3 + i % 1021}" for i in range(1800)),
]


@pytest.mark.parametrize("which", ["word_level", "byte_level_bpe"])
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("special", [True, False])
def test_the_backend_gives_the_ids_transformers_gives(
    which: str, text: str, special: bool, request: pytest.FixtureRequest
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(which)
    assert tokenizer.backend is not None  # the fast path is the one under test
    expected = list(tokenizer.hf(text, add_special_tokens=special).input_ids)
    assert tokenizer.encode(text, special) == expected


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300), special=st.booleans())
def test_any_text_gets_the_ids_transformers_gives(
    byte_level_bpe: Tokenizer, word_level: Tokenizer, text: str, special: bool
) -> None:
    for tokenizer in (byte_level_bpe, word_level):
        expected = list(tokenizer.hf(text, add_special_tokens=special).input_ids)
        assert tokenizer.encode(text, special) == expected


def test_requests_read_through_the_backend_as_through_transformers(
    byte_level_bpe: Tokenizer,
) -> None:
    hf = byte_level_bpe.hf
    prompt = "Routing requests to the engine, naïve café 🙂"
    assert byte_level_bpe.completion({"prompt": prompt}) == list(hf(prompt).input_ids)
    assert byte_level_bpe.completion({"prompt": prompt, "add_special_tokens": False}) == list(
        hf(prompt, add_special_tokens=False).input_ids
    )
    assert byte_level_bpe.completion({"prompt": [prompt, "other"]}) == list(hf(prompt).input_ids)


class _Lowercasing:
    """A tokenizer whose Python side rewrites its input before the backend sees it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.backend_tokenizer = inner.backend_tokenizer
        self.all_special_tokens = inner.all_special_tokens

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
        return self.inner(text.lower(), add_special_tokens=add_special_tokens)


def test_a_tokenizer_with_steps_of_its_own_keeps_going_through_transformers(
    byte_level_bpe: Tokenizer,
) -> None:
    lowercasing = _Lowercasing(byte_level_bpe.hf)
    assert _same_backend(lowercasing) is None
    wrapped = Tokenizer.__new__(Tokenizer)
    wrapped.hf, wrapped.backend = lowercasing, None
    assert wrapped.completion({"prompt": "The Fox"}) == list(byte_level_bpe.hf("the fox").input_ids)


def test_a_tokenizer_without_a_rust_backend_goes_through_transformers(
    byte_level_bpe: Tokenizer,
) -> None:
    class Slow:
        def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
            return byte_level_bpe.hf(text, add_special_tokens=add_special_tokens)

    assert _same_backend(Slow()) is None


async def test_prompts_read_in_place_and_on_the_threads_at_once_give_the_same_ids(
    byte_level_bpe: Tokenizer,
) -> None:
    """Small bodies are tokenized on the loop, large ones on two threads, all sharing
    one backend: many of each at once get exactly the ids transformers gives, and the
    body sent on as those ids (``--send-token-ids``) carries them."""
    import asyncio
    import json

    from kvbus.service.prompt_ids import Agreement, EngineChecks
    from kvbus.service.served_model import _INLINE_TOKENIZE_BYTES, ServedModel

    async def agreeing(base: str) -> Agreement:
        return Agreement(None)

    served = ServedModel({}, None, None, max_tokenize_bytes=1 << 20)  # type: ignore[arg-type]
    served.tokenizer = byte_level_bpe
    served.checks = EngineChecks(agreeing, lambda: ["http://engine"])
    served.checks.agrees("http://engine")  # its check starts, and answers at once
    for _ in range(100):
        if served.checks.any_agree:
            break
        await asyncio.sleep(0)
    words = "The quick brown fox jumps over the lazy dog, naïve café 🙂".split()
    prompts = [
        " ".join(words[(i + k) % len(words)] for k in range(n))
        for i, n in enumerate([10, 200, 3000, 5000] * 6)
    ]
    bodies = [json.dumps({"prompt": p}).encode() for p in prompts]
    assert min(map(len, bodies)) <= _INLINE_TOKENIZE_BYTES < max(map(len, bodies))
    try:
        read = await asyncio.gather(
            *(served.read(b, lambda t, body: t.completion(body), True) for b in bodies)
        )
    finally:
        served.close()
    for prompt, (got, sent) in zip(prompts, read, strict=True):
        assert got is not None
        assert got.tokens == list(byte_level_bpe.hf(prompt).input_ids)
        assert sent is not None and json.loads(sent) == {"prompt": got.tokens}
