"""A long prompt tokenized in segments, the ids of segments seen again kept: prompts
that share a prefix (a system prompt, a document, the turns of a conversation so far)
pay the tokenizer only for what follows it.

Tokenizers split text into pre-tokens (words, with or without their leading space)
before their model (BPE, WordPiece, Unigram, word-level) turns each pre-token into ids
on its own. A cut where every pre-tokenizer in use splits anyway (`cuts`: before a
single space that follows an ASCII letter or digit and precedes an ASCII letter) leaves
the ids as they were: the ids of the text are the ids of its segments, one after
another, with the special tokens (a BOS) around them. That holds for the common
tokenizers (byte-level BPE with GPT-2's, Llama 3's or Qwen's split rules, Metaspace,
BERT's, whitespace) and for one that keeps the text in one pre-token if no piece of its
vocabulary runs over a space (`words_stay_apart`); not for every one (a normalizer that
prepends a mark to the whole text, an added token that swallows the spaces around it):
`SegmentedEncoder.fits` checks the tokenizer on texts cut at every such place, with and
without special tokens, and a tokenizer that fails either check is never used in
segments.

Only segments seen twice are kept, in a few MiB: a prompt seen once costs one call of the
tokenizer, as before, and what is kept stays small. Kept in tens of MiB, every segment of
unshared 1,800-token prompts made the tokenizer itself (Rust, on the process's heap) 70%
slower, for whole texts too.

llm-d's prefix store keeps tokens of text prefixes too, and takes the tokens whose
offsets fall in the matched text (approximate at the seam); here the ids are the
tokenizer's own for the whole text wherever `fits` holds."""

from __future__ import annotations

import itertools
import random
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

SEGMENT_CHARS: Final = 1024
"""Characters a segment has at least (a prompt's last has what is left): a prefix shared
to within this many characters of its end is found whole."""
SEGMENTED_FROM: Final = 2 * SEGMENT_CHARS
"""Shorter texts are tokenized whole: cutting them costs more than it saves (a segment
tokenized on its own is a call of the tokenizer, ~2.5 µs, and short texts cost a little
more a token: 1,800 tokens in nine calls ~15% more than in one)."""
CACHED_BYTES: Final = 8 * 1024 * 1024
"""What the kept segments may take, their text and their ids (4 bytes each); one segment
at most a sixteenth of it (a long text without a cut is tokenized whole, not kept)."""

Encode = Callable[[Sequence[str], bool], list[list[int]]]
"""The tokenizer's ids for each of several texts, with or without special tokens."""


_CUT: Final = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")


def cuts(text: str, every: int) -> list[int]:
    """Where ``text`` is cut: the first place at least ``every`` characters after the
    previous cut (or the start) that lies before a single space between an ASCII letter
    or digit and an ASCII letter. The same prefix gives the same cuts, whatever follows
    it (a cut looks one character past the space), so prompts sharing a prefix share its
    segments. One pass of the regular expression engine over the text."""
    found: list[int] = []
    at = every
    while (cut := _CUT.search(text, at)) is not None:
        found.append(cut.start())
        at = cut.start() + every
    return found


_ACROSS: Final = re.compile(r"[A-Za-z0-9][ \u2581\u0120]")
"""A vocabulary piece that runs from a word over the space after it (as " ", SentencePiece's
"▁" or byte-level BPE's "Ġ"): "of▁", "of▁the"."""


def words_stay_apart(backend: Any) -> bool:
    """Whether ``backend`` (a `tokenizers.Tokenizer`) never puts the end of one word and
    the space after it in one token, so a cut there leaves its ids as they were: its
    pre-tokenizer splits "ab cd ef" into its three words (each with or without its space
    or the mark that replaces it), or, where it does not (none, a Metaspace with
    ``split=False`` as transformers converts SentencePiece models, a byte-level one
    without its regex), no piece of its vocabulary runs over a space (`_ACROSS`).
    Probes alone would find such a piece only by luck."""
    pre = backend.pre_tokenizer
    if pre is not None:
        text = "ab cd ef"
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        words = [piece.strip(" \u2581\u0120") for piece, _ in pre.pre_tokenize_str(text)]
        if words == ["ab", "cd", "ef"]:
            return True
    pieces: dict[str, int] = backend.get_vocab(with_added_tokens=False)
    return not any(_ACROSS.search(piece) for piece in pieces)


Key = str | tuple[str, str]
"""A kept segment: its text, or with a ``cache_salt`` the salt and its text."""

_ENTRY_BYTES: Final = 120
"""What keeping one more segment costs besides its text and ids (the ordered dict's
entry, the key's references)."""
_SEEN_BYTES: Final = 64
"""What remembering one segment's hash costs (the set's slot, the int)."""


def _size(key: Key, ids: array[int]) -> int:
    text = key if isinstance(key, str) else key[1]
    return sys.getsizeof(text) + sys.getsizeof(ids) + _ENTRY_BYTES


class SegmentedEncoder:
    """``encode``'s ids for a long text from its segments' (`cuts`): segments kept are
    not tokenized again. A segment is kept from its second sighting (a prompt seen once,
    as most are, costs one call of the tokenizer and is not kept: the hashes of segments
    seen remember it), while what is kept takes under ``cached_bytes`` with those hashes
    (least recently used dropped first; the hashes, an eighth of it, forgotten all at
    once).
    A prompt with a ``cache_salt`` shares segments only with prompts of the same salt
    (as vLLM shares its blocks), so that how long it takes tells nothing of other
    tenants' prompts. Safe to call from several threads."""

    def __init__(
        self,
        encode: Encode,
        *,
        every: int = SEGMENT_CHARS,
        cached_bytes: int = CACHED_BYTES,
    ) -> None:
        self._encode = encode
        self.every = every
        self.seen_limit = max(64, cached_bytes // 8 // _SEEN_BYTES)
        """Hashes of segments seen, forgotten all at once past this many."""
        self.kept_limit = cached_bytes - self.seen_limit * _SEEN_BYTES
        self._kept: OrderedDict[Key, array[int]] = OrderedDict()
        self._bytes = 0
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        """Segments found kept, and segments tokenized."""
        plain, marked = encode(["a"], False)[0], encode(["a"], True)[0]
        self._head: list[int] = []
        self._tail: list[int] = []
        for start in range(len(marked) - len(plain) + 1):
            if marked[start : start + len(plain)] == plain:
                self._head, self._tail = marked[:start], marked[start + len(plain) :]
                break
        """The special tokens the tokenizer puts before and after a text's own ids."""

    def encode(self, text: str, add_special_tokens: bool, salt: str | None = None) -> list[int]:
        """``text``'s ids as the tokenizer gives them for the whole text (where `fits`):
        each segment's kept ids, or its own call where it was seen before (then kept),
        and the runs of segments between those in one call each (their hashes
        remembered)."""
        bounds = [0, *cuts(text, self.every), len(text)]
        segments = [text[a:b] for a, b in itertools.pairwise(bounds)]
        keys: list[Key] = [*segments] if salt is None else [(salt, s) for s in segments]
        hashes = [hash(k) for k in keys]  # (outside the lock: a str caches its hash)
        with self._lock:
            found = [self._kept.get(k) for k in keys]
            again = [ids is None and h in self._seen for ids, h in zip(found, hashes, strict=True)]
            for key, ids in zip(keys, found, strict=True):
                if ids is not None:
                    self._kept.move_to_end(key)
            if len(self._seen) + len(keys) > self.seen_limit:
                self._seen.clear()
            self._seen.update(hashes)
            self.hits += sum(ids is not None for ids in found)
            self.misses += sum(ids is None for ids in found)
        twice = [i for i, seen in enumerate(again) if seen]
        if twice:
            encoded = self._encode([segments[i] for i in twice], False)
            fresh = iter(self._keep([keys[i] for i in twice], encoded))
            found = [next(fresh) if seen else ids for ids, seen in zip(found, again, strict=True)]
        pieces: list[Sequence[int]] = []
        start = None  # of the run of segments not found nor seen before
        for index, ids in enumerate([*found, array("I")]):
            if ids is None:
                start = index if start is None else start
                continue
            if start is not None:  # the run, in one call
                pieces += self._encode([text[bounds[start] : bounds[index]]], False)
                start = None
            pieces.append(ids)
        return self._joined(pieces, add_special_tokens)

    def _joined(self, pieces: Sequence[Sequence[int]], add_special_tokens: bool) -> list[int]:
        """The pieces' ids one after another, with the special tokens around them."""
        out = list(self._head) if add_special_tokens else []
        for ids in pieces:
            out += ids
        return out + self._tail if add_special_tokens else out

    def _keep(self, keys: list[Key], encoded: list[list[int]]) -> list[array[int]]:
        kept = [array("I", ids) for ids in encoded]
        with self._lock:
            for key, ids in zip(keys, kept, strict=True):
                size = _size(key, ids)
                if key in self._kept or size > self.kept_limit // 16:
                    continue  # (another thread tokenized it meanwhile; or one huge)
                self._kept[key] = ids
                self._bytes += size
            while self._bytes > self.kept_limit and self._kept:
                self._bytes -= _size(*self._kept.popitem(last=False))
        return kept

    def fits(self, probes: Sequence[str]) -> bool:
        """Whether the tokenizer gives the same ids in segments as whole, with and without
        special tokens, for ``probes`` and for texts made of them and of words,
        punctuation, digits, spaces, accents, CJK and emoji, cut everywhere `cuts` may
        (every segment tokenized on its own, none kept)."""
        rng = random.Random(0)
        given = sorted({p for probe in probes for p in probe.split()})
        words = [
            *rng.sample(given, min(len(given), 64)),  # (some tokenizers add thousands)
            "the", "Hello", "don't", "it's", "w3", "w1023", "42", "3.14", "x1",
            "naïve", "café", "世界", "🙂", "--", "...", "a,b", "(yes)", "#", "\n", "\t",
            "  ", "\r\n", "Ünïcode", "\uff41\uff42\uff43", "ÅB", "İ", "ß", "e\u0301",
        ]  # fmt: skip
        texts = list(probes)
        for _ in range(300):
            parts = [rng.choice(words) for _ in range(rng.randrange(1, 40))]
            texts.append("".join(p + rng.choice(("", " ", " ", " ", "  ", "\n")) for p in parts))
        for special in (True, False):
            whole = self._encode(texts, special)
            for text, ids in zip(texts, whole, strict=True):
                if self._in_segments(text, special, every=1) != list(ids):
                    return False
        return True

    def _in_segments(self, text: str, add_special_tokens: bool, every: int) -> list[int]:
        """``text``'s ids from every segment's own, none kept."""
        bounds = [0, *cuts(text, every), len(text)]
        segments = [text[a:b] for a, b in itertools.pairwise(bounds)]
        return self._joined(self._encode(segments, False), add_special_tokens)
