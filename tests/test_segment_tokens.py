"""The router's tokenizer reads a long prompt in segments (kvbus.service.segment_tokens):
the ids are the tokenizer's for the whole text, on the tests' word-level tokenizer, a
trained byte-level BPE and the real vocabularies vLLM ships through mistral_common (a
SentencePiece BPE, Mistral Nemo's tiktoken BPE with its own split, Llama 3's and
GPT-2's); a tokenizer whose ids change in segments (a normalizer that prepends a mark to
the whole text or strips it, an added token that takes the spaces beside it) is never
read in segments; a prompt seen once is tokenized in one piece and keeps nothing, a
segment seen again is kept and not tokenized after; what is kept stays within its bytes;
and the router sends the whole text's ids, counts the segments in /metrics and keeps
none with ``--prompt-cache-mib 0``."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cluster import make_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbus.service.segment_tokens import (
    SEGMENT_CHARS,
    SEGMENTED_FROM,
    SegmentedEncoder,
    cuts,
    words_stay_apart,
)
from kvbus.service.served_model import Tokenizer, _segmented

from .test_gateway_limits import fleet as fleet  # the router's fixtures
from .test_gateway_limits import tokenizer as tokenizer
from .test_tokenizer_backend import byte_level_bpe as byte_level_bpe

REPO = Path(__file__).resolve().parents[1]


def _encoder(backend: Any) -> Callable[[Sequence[str], bool], list[list[int]]]:
    def encode(texts: Sequence[str], special: bool) -> list[list[int]]:
        return [e.ids for e in backend.encode_batch_fast(list(texts), add_special_tokens=special)]

    return encode


def _whole(backend: Any, text: str, special: bool) -> list[int]:
    return list(backend.encode(text, add_special_tokens=special).ids)


def _real_text() -> str:
    return "".join(
        (REPO / name).read_text()
        for name in ("README.md", "kvbus/service/served_model.py", "kvbus/routing/README.md")
    )


# --- where a text is cut -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ab cd ef", [2, 5]),
        ("a1 cd", [2]),
        ("ab 12", []),  # a digit after the space: "  12" may join a number
        ("ab  cd", []),  # two spaces: whitespace runs split by what follows
        ("ab\tcd ef", [5]),
        ("é cd", []),  # only ASCII on both sides
        ("ab é", []),
        ("ab. cd", []),  # punctuation before: GPT-2's " ?[^\s\p{L}\p{N}]+" may take it
        ("ab c", [2]),
        ("ab ", []),  # nothing after the space yet
        ("", []),
        (" ab", []),
    ],
)
def test_a_text_is_cut_only_before_a_single_space_between_ascii_words(
    text: str, expected: list[int]
) -> None:
    assert cuts(text, 1) == expected


def test_cuts_are_at_least_every_characters_apart() -> None:
    text = " ".join(["word"] * 400)
    found = cuts(text, 100)
    assert found and all(b - a >= 100 for a, b in zip([0, *found], found, strict=False))
    assert found[0] >= 100


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="ab1 .é\n", max_size=300),
    st.text(alphabet="ab1 .é\n", max_size=50),
    st.text(alphabet="ab1 .é\n", max_size=50),
    st.integers(1, 40),
)
def test_texts_that_share_a_prefix_are_cut_alike_within_it(
    prefix: str, one: str, other: str, every: int
) -> None:
    """A cut looks one character past its space: within a shared prefix (but its last
    character) two texts have the same cuts, so the same segments."""
    inside = len(prefix) - 1
    first = [c for c in cuts(prefix + one, every) if c < inside]
    second = [c for c in cuts(prefix + other, every) if c < inside]
    assert first == second


# --- the ids are the whole text's ----------------------------------------------------------


@pytest.fixture(scope="module")
def word_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("word-level")
    make_model(directory)
    return Tokenizer(str(directory), segments_bytes=2**24)


@pytest.fixture(scope="module")
def segmented_bpe(byte_level_bpe: Tokenizer) -> Tokenizer:
    """test_tokenizer_backend's byte-level BPE (GPT-2's split, ``<s>`` first), in
    segments."""
    return Tokenizer(byte_level_bpe.hf.name_or_path, segments_bytes=2**24)


@pytest.mark.parametrize("which", ["word_level", "segmented_bpe"])
@pytest.mark.parametrize("special", [True, False])
def test_long_prompts_get_the_ids_of_the_whole_text(
    which: str, special: bool, request: pytest.FixtureRequest
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(which)
    assert tokenizer.segments is not None  # the segmented path is the one under test
    rng = random.Random(which)
    words = " ".join(f"w{rng.randrange(3, 1024)}" for _ in range(2000))
    text = _real_text()
    pieces = [words, words[:3001] + " x", *(text[a : a + 6000] for a in range(0, 60000, 7919))]
    for piece in pieces:
        assert len(piece) >= SEGMENTED_FROM
        expected = list(tokenizer.hf(piece, add_special_tokens=special).input_ids)
        assert tokenizer.encode(piece, special) == expected  # one piece
        assert tokenizer.encode(piece, special) == expected  # seen again: kept
        tokenized, kept = tokenizer.segments.misses, tokenizer.segments.hits
        assert tokenizer.encode(piece, special) == expected  # from the kept segments
        assert tokenizer.segments.misses == tokenized
        assert tokenizer.segments.hits > kept


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=SEGMENTED_FROM, max_size=3 * SEGMENTED_FROM), st.booleans())
def test_any_text_gets_the_ids_of_the_whole_text(
    segmented_bpe: Tokenizer, text: str, special: bool
) -> None:
    words = text.replace("\x00", "") + " ".join(["ab cd 12 ef."] * 200)
    expected = list(segmented_bpe.hf(words, add_special_tokens=special).input_ids)
    for _ in range(3):  # one piece, then segment by segment, then from those kept
        assert segmented_bpe.encode(words, special) == expected


def _sentencepiece(legacy: bool) -> Any:
    """Mistral's first SentencePiece BPE (Llama 2's scheme), from mistral_common's data,
    the way transformers converts it: a Metaspace pre-tokenizer, or with ``legacy`` the
    old tokenizer.json's normalizer that prepends "▁" to the whole text."""
    pytest.importorskip("sentencepiece")
    mistral = pytest.importorskip("mistral_common")
    from tokenizers import AddedToken, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    model = Path(mistral.__file__).parent / "data" / "tokenizer.model.v1"
    spm = SentencePieceExtractor(str(model)).extract(BPE)
    rust = RustTokenizer(
        BPE(vocab=spm["vocab"], merges=spm["merges"], unk_token="<unk>", fuse_unk=True,
            byte_fallback=True)
    )  # fmt: skip
    rust.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    if legacy:
        rust.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        rust.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", rust.token_to_id("<s>"))]
    )
    return rust


_LLAMA_3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT_2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _tekken(split: str | None, tmp_path: Path) -> Any:
    """Mistral Nemo's tiktoken BPE (mistral_common's tekken file) as transformers
    converts it, with its own split rule or ``split``, adding ``<s>`` first."""
    mistral = pytest.importorskip("mistral_common")
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tekken = json.loads((Path(mistral.__file__).parent / "data" / "tekken_240911.json").read_text())
    config = tekken["config"]
    ranks = tmp_path / "tekken.tiktoken"
    kept = config["default_vocab_size"] - config["default_num_special_tokens"]
    ranks.write_text("".join(f"{v['token_bytes']} {v['rank']}\n" for v in tekken["vocab"][:kept]))
    rust = TikTokenConverter(
        vocab_file=str(ranks), pattern=split or config["pattern"], additional_special_tokens=[]
    ).converted()
    rust.add_special_tokens([AddedToken("<s>", special=True)])
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", rust.token_to_id("<s>"))]
    )
    return rust


def _check_real_text(rust: Any) -> int:
    """Differences from the whole text's ids, over 150 pieces of this repository's text
    (up to 4,000 characters each, cut every 64 or more), with and without a BOS."""
    segments = SegmentedEncoder(_encoder(rust))
    rng = random.Random(0)
    text = _real_text()
    wrong = 0
    for _ in range(150):
        start = rng.randrange(len(text))
        piece = text[start : start + rng.randrange(100, 4000)]
        for special in (True, False):
            wrong += segments._in_segments(piece, special, 64) != _whole(rust, piece, special)
    return wrong


@pytest.mark.parametrize("split", ["tekken", "llama-3", "gpt-2"])
def test_real_byte_level_vocabularies_fit_and_give_the_whole_texts_ids(
    split: str, tmp_path: Path
) -> None:
    rust = _tekken(
        {"tekken": None, "llama-3": _LLAMA_3_SPLIT, "gpt-2": _GPT_2_SPLIT}[split], tmp_path
    )
    assert words_stay_apart(rust)
    assert SegmentedEncoder(_encoder(rust)).fits(["<s> w3"])
    assert _check_real_text(rust) == 0


def test_a_real_sentencepiece_vocabulary_fits_and_gives_the_whole_texts_ids() -> None:
    rust = _sentencepiece(legacy=False)
    assert words_stay_apart(rust)  # one pre-token (split=False), no piece over a space
    assert SegmentedEncoder(_encoder(rust)).fits(["<s> w3 </s>"])
    assert _check_real_text(rust) == 0


def test_a_normalizer_that_marks_the_whole_text_does_not_fit() -> None:
    rust = _sentencepiece(legacy=True)
    assert _check_real_text(rust) > 0  # what reading it in segments would do
    assert not SegmentedEncoder(_encoder(rust)).fits(["<s> w3 </s>"])


def _with(rust: Any, **changes: Any) -> Any:
    from tokenizers import Tokenizer as RustTokenizer

    copy = RustTokenizer.from_str(rust.to_str())
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy


def test_a_normalizer_that_strips_the_text_does_not_fit(tmp_path: Path) -> None:
    from tokenizers import normalizers

    rust = _with(_tekken(_LLAMA_3_SPLIT, tmp_path), normalizer=normalizers.Strip())
    assert _check_real_text(rust) > 0
    assert not SegmentedEncoder(_encoder(rust)).fits([])


def test_an_added_token_that_takes_the_spaces_beside_it_keeps_the_text_whole(
    byte_level_bpe: Tokenizer,
) -> None:
    from tokenizers import AddedToken

    rust = _with(byte_level_bpe.backend)
    rust.add_tokens([AddedToken("routing", rstrip=True)])
    text = "ab routing cd " * 300
    segments = SegmentedEncoder(_encoder(rust), every=1)
    assert segments._in_segments(text, False, every=1) != _whole(rust, text, False)
    assert _segmented(rust, byte_level_bpe.hf, 2**24) is None


def test_a_tokenizer_that_does_not_fit_reads_every_text_whole(tmp_path: Path) -> None:
    """`Tokenizer` with such a backend: no segments, the whole text's ids."""
    from transformers import PreTrainedTokenizerFast

    rust = _sentencepiece(legacy=True)
    PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(tmp_path)
    tokenizer = Tokenizer(str(tmp_path), segments_bytes=2**24)
    assert tokenizer.backend is not None and tokenizer.segments is None
    text = _real_text()[:5000]
    assert tokenizer.encode(text, True) == list(tokenizer.hf(text).input_ids)


def test_the_simulated_engines_tokenizer_reads_every_text_whole(word_level: Tokenizer) -> None:
    """`kvbus sim` mimics vLLM's server, which tokenizes every prompt whole."""
    assert Tokenizer(str(word_level.hf.name_or_path)).segments is None


# --- what is kept --------------------------------------------------------------------------


class _Counting:
    """An encode that records the texts it was asked for."""

    def __init__(self, backend: Any) -> None:
        self.inner = _encoder(backend)
        self.asked: list[str] = []

    def __call__(self, texts: Sequence[str], special: bool) -> list[list[int]]:
        self.asked += texts
        return self.inner(texts, special)


def test_a_prompt_seen_once_is_tokenized_in_one_piece_and_not_kept(
    word_level: Tokenizer,
) -> None:
    counting = _Counting(word_level.backend)
    segments = SegmentedEncoder(counting, every=256)
    counting.asked.clear()  # (its special tokens, read on creation)
    rng = random.Random(4)
    texts = [" ".join(f"w{rng.randrange(3, 1024)}" for _ in range(900)) for _ in range(20)]
    for text in texts:
        assert segments.encode(text, True) == _whole(word_level.backend, text, True)
    assert counting.asked == texts
    assert len(segments._kept) == 0


def test_a_shared_prefix_is_kept_once_seen_again_and_not_tokenized_after(
    word_level: Tokenizer,
) -> None:
    counting = _Counting(word_level.backend)
    segments = SegmentedEncoder(counting, every=256)
    counting.asked.clear()
    rng = random.Random(1)
    prefix = " ".join(f"w{rng.randrange(3, 1024)}" for _ in range(1500))
    prompts = [
        prefix + " " + " ".join(f"w{rng.randrange(3, 1024)}" for _ in range(300)) for _ in range(4)
    ]
    asked = []
    for prompt in prompts:
        counting.asked.clear()
        assert segments.encode(prompt, True) == _whole(word_level.backend, prompt, True)
        asked.append(sum(map(len, counting.asked)))
    assert asked[:2] == [len(prompts[0]), len(prompts[1])]  # seen once, then kept
    for prompt, chars in zip(prompts[2:], asked[2:], strict=True):
        # Only the tail after the prefix's last whole segment: at most one segment of it.
        assert chars <= len(prompt) - len(prefix) + 256 + 8
    assert segments.hits >= 2 * (len(prefix) // (256 + 8))


def test_the_hashes_of_segments_seen_once_stay_bounded(word_level: Tokenizer) -> None:
    segments = SegmentedEncoder(_encoder(word_level.backend), every=16)
    segments.seen_limit = 1000
    rng = random.Random(5)
    for _ in range(100):
        text = " ".join(f"w{rng.randrange(3, 1024)}" for _ in range(400))
        segments.encode(text, False)
        assert len(segments._seen) <= 1000


def test_segments_after_a_prompts_own_start_are_found_kept(word_level: Tokenizer) -> None:
    """A shared document after a header of each request's own, as long as the others'
    (a timestamp, an id: cuts are counted from the start, so a header of another length
    would move them): the document's segments are kept and found, the headers, seen once
    each, never kept."""
    counting = _Counting(word_level.backend)
    segments = SegmentedEncoder(counting, every=256)
    rng = random.Random(6)
    document = " ".join(f"w{rng.randrange(3, 1024)}" for _ in range(1500))
    headers = [" ".join(f"w{rng.randrange(100, 1000)}" for _ in range(60)) for _ in range(4)]
    for header in headers:
        counting.asked.clear()
        text = f"{header} {document}"
        assert segments.encode(text, True) == _whole(word_level.backend, text, True)
    assert max(map(len, counting.asked)) <= 256 + 8 + len(headers[-1])  # none whole
    assert sum(map(len, counting.asked)) < 2 * (len(headers[-1]) + 256 + 8)
    kept = {key if isinstance(key, str) else key[1] for key in segments._kept}
    assert not any(header in segment for header in headers for segment in kept)


def test_a_salted_prompt_shares_segments_only_with_its_salt(word_level: Tokenizer) -> None:
    counting = _Counting(word_level.backend)
    segments = SegmentedEncoder(counting, every=256)
    text = " ".join(f"w{3 + i % 1000}" for i in range(900))
    expected = _whole(word_level.backend, text, True)
    for _ in range(2):  # seen, then kept: for salt "a" only
        assert segments.encode(text, True, "a") == expected
    counting.asked.clear()
    assert segments.encode(text, True, "a") == expected
    assert counting.asked == []
    for salt in ("b", None):
        assert segments.encode(text, True, salt) == expected
        assert counting.asked == [text]  # not found: tokenized in one piece
        counting.asked.clear()


def _crossing(split: bool, across: bool) -> Any:
    """A SentencePiece-style BPE (Metaspace, ``<s>`` first) with, where ``across``, one
    piece that runs over a space ("▁of▁the")."""
    from tokenizers import AddedToken, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789▁.,'")
    vocab = {c: i for i, c in enumerate(["<unk>", "<s>", "</s>", *chars])}
    merges = [("o", "f"), ("▁", "of"), ("t", "h"), ("th", "e"), ("▁", "the")]
    merges += [("▁of", "▁the")] if across else []
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    rust = RustTokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    rust.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    rust.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=split)
    rust.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize(("split", "across", "read_in_segments"), [
    (False, True, False),  # one pre-token, a piece over a space: the ids would differ
    (False, False, True),  # one pre-token, no piece over a space: as transformers' Llama
    (True, True, True),  # the pre-tokenizer splits words apart: the piece never forms
])  # fmt: skip
def test_a_vocabulary_piece_over_a_space_keeps_the_text_whole_unless_words_are_split(
    split: bool, across: bool, read_in_segments: bool
) -> None:
    hf = _crossing(split, across)
    segments = _segmented(hf.backend_tokenizer, hf, 2**22)
    assert (segments is not None) == read_in_segments
    text = "x" * 1020 + "yz of the end " + "word " * 300  # a cut between "of" and " the"
    assert (
        SegmentedEncoder(_encoder(hf.backend_tokenizer))._in_segments(text, True, 1024)
        == list(hf(text).input_ids)
    ) == (not across or split)
    if segments is not None:
        for _ in range(3):
            assert segments.encode(text, True) == list(hf(text).input_ids)


def test_what_is_kept_stays_within_its_bytes_and_drops_the_least_recently_used(
    word_level: Tokenizer,
) -> None:
    counting = _Counting(word_level.backend)
    budget = 64 * 1024
    segments = SegmentedEncoder(counting, every=512, cached_bytes=budget)
    rng = random.Random(2)
    texts = [" ".join(f"w{rng.randrange(3, 1024)}" for _ in range(600)) for _ in range(60)]
    for text in texts:
        segments.encode(text, False)
        segments.encode(text, False)  # (kept from its second sighting)
        segments.encode(texts[0], False)  # the first text: used with every other one
        assert segments._bytes <= segments.kept_limit < budget
    assert len(segments._kept) < sum(len(cuts(t, 512)) + 1 for t in texts)
    counting.asked.clear()
    segments.encode(texts[0], False)
    assert counting.asked == []  # the recently used stayed
    segments.encode(texts[1], False)
    assert counting.asked  # the least recently used went


def test_segments_read_from_several_threads_at_once_give_the_whole_texts_ids(
    byte_level_bpe: Tokenizer,
) -> None:
    backend = byte_level_bpe.backend
    segments = SegmentedEncoder(_encoder(backend), every=128, cached_bytes=16 * 1024)
    text = _real_text()
    pieces = [text[a : a + 3000] for a in range(0, 40000, 1000)]
    expected = {p: _whole(backend, p, True) for p in pieces}
    wrong: list[str] = []

    def read(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(100):
            piece = rng.choice(pieces)
            if segments.encode(piece, True) != expected[piece]:
                wrong.append(piece)

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    assert segments._bytes <= 16 * 1024


# --- through the router ------------------------------------------------------------------


async def test_the_router_sends_the_whole_texts_ids_and_counts_the_segments(
    fleet: Any, tokenizer: Path
) -> None:
    """Three long prompts sharing a prefix through the router (in this process, scripted
    workers that tokenize as vLLM does): each engine gets the whole text's ids, and
    /metrics counts the third prompt's shared segments as kept."""
    from .test_gateway_limits import complete
    from .test_prompt_ids import checked, worker_tokenizing

    seen: list[dict[str, Any]] = []
    await worker_tokenizing(fleet, tokenizer, seen)
    await fleet.run_router(tokenizer, send_token_ids=True)
    assert await checked(fleet) == "sent as token ids (1 engine checked)"
    whole = Tokenizer(str(tokenizer))
    rng = random.Random(3)
    prefix = " ".join(f"w{rng.randrange(3, 1024)}" for _ in range(1200))
    prompts = [f"{prefix} {' '.join(f'w{rng.randrange(3, 1024)}' for _ in range(200))}"]
    prompts += [f"{prefix} w5 w6", f"{prefix} w7"]  # the prefix seen again, then kept
    for prompt in prompts:
        status, answer, _ = await complete(fleet, {"model": "m", "prompt": prompt, "max_tokens": 1})
        assert status == 200, answer
    assert [body["prompt"] for body in seen] == [whole.encode(p, True) for p in prompts]
    assert whole.segments is None
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{fleet.router_url}/metrics") as response:
            text = await response.text()
    counts = {
        line.split('source="')[1].split('"')[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("kvbus_router_prompt_segments_total{")
    }
    assert counts["cache"] >= len(prefix) // (SEGMENT_CHARS + 8) - 1  # the prefix's segments
    assert counts["tokenizer"] > 0


def test_the_command_line_sizes_the_kept_segments_and_0_turns_them_off() -> None:
    import argparse

    from kvbus.service.gateway import add_arguments, build

    def parsed(*more: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return parser.parse_args(["--worker", "w=http://127.0.0.1:1", *more])

    assert build(parsed()).served.prompt_cache_bytes == 8 * 2**20
    assert build(parsed("--prompt-cache-mib", "1.5")).served.prompt_cache_bytes == 3 * 2**19
    assert build(parsed("--prompt-cache-mib", "0")).served.prompt_cache_bytes == 0
    for wrong in ("-1", "0.5", "nan", "inf", "lots"):
        with pytest.raises(SystemExit):
            parsed("--prompt-cache-mib", wrong)


async def test_with_no_memory_for_segments_every_prompt_is_tokenized_whole(
    fleet: Any, tokenizer: Path
) -> None:
    from .test_gateway_limits import complete
    from .test_prompt_ids import checked, worker_tokenizing

    seen: list[dict[str, Any]] = []
    await worker_tokenizing(fleet, tokenizer, seen)
    await fleet.run_router(tokenizer, send_token_ids=True, prompt_cache_bytes=0)
    await checked(fleet)
    prompt = " ".join(f"w{3 + i % 1000}" for i in range(1500))
    status, answer, _ = await complete(fleet, {"model": "m", "prompt": prompt, "max_tokens": 1})
    assert status == 200, answer
    assert fleet.app.served.tokenizer.segments is None
    assert seen[0]["prompt"] == Tokenizer(str(tokenizer)).encode(prompt, True)


def test_a_requests_cache_salt_keys_its_segments(word_level: Tokenizer) -> None:
    """Through `Tokenizer`: a completion's and a chat's ``cache_salt`` (vLLM's: a string)."""
    segments = word_level.segments
    assert segments is not None
    prompt = " ".join(f"w{3 + (7 * i) % 1000}" for i in range(900))
    salted = {"prompt": prompt, "cache_salt": "tenant-a"}
    for _ in range(2):
        word_level.completion(salted)
    found = segments.hits
    assert word_level.completion(salted) == word_level.completion({"prompt": prompt})
    assert segments.hits > found  # the salted ones, kept for its salt
    assert any(isinstance(key, tuple) and key[0] == "tenant-a" for key in segments._kept)
    chat = {"messages": [{"role": "user", "content": prompt}], "cache_salt": "tenant-b"}
    word_level.chat(chat)
    word_level.chat(chat)
    assert any(isinstance(key, tuple) and key[0] == "tenant-b" for key in segments._kept)
