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
BERT's, whitespace) and not for every one (a normalizer that prepends a mark to the
whole text, an added token that swallows the spaces around it): `SegmentedEncoder.fits`
checks the tokenizer on texts cut at every such place, with and without special tokens,
and a tokenizer that gives other ids for any of them is never used in segments.

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
from collections.abc import Callable, Iterable, Sequence
from typing import Final

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


def _size(segment: str, ids: array[int]) -> int:
    return sys.getsizeof(segment) + sys.getsizeof(ids)


class SegmentedEncoder:
    """``encode``'s ids for a long text from its segments' (`cuts`): the segments it
    starts with that were kept are not tokenized again. A segment is kept from its second
    sighting (a prompt seen once, as most are, costs one call of the tokenizer and is not
    kept: ``SEEN`` hashes remember what was seen), while the segments kept take under
    ``cached_bytes`` (least recently used dropped first). Safe to call from several
    threads."""

    SEEN: Final = 1 << 16
    """Hashes of segments seen once, forgotten all at once past this many."""

    def __init__(
        self,
        encode: Encode,
        *,
        every: int = SEGMENT_CHARS,
        cached_bytes: int = CACHED_BYTES,
    ) -> None:
        self._encode = encode
        self.every = every
        self.cached_bytes = cached_bytes
        self._kept: OrderedDict[str, array[int]] = OrderedDict()
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

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s ids as the tokenizer gives them for the whole text (where `fits`):
        the segments kept it starts with, then those seen before (tokenized one by one and
        kept), then the rest in one piece (its segments' hashes remembered)."""
        bounds = [0, *cuts(text, self.every), len(text)]
        segments = [text[a:b] for a, b in itertools.pairwise(bounds)]
        found: list[array[int]] = []
        with self._lock:
            for segment in segments:
                ids = self._kept.get(segment)
                if ids is None:
                    break
                self._kept.move_to_end(segment)
                found.append(ids)
            rest = segments[len(found) :]
            again = max((i + 1 for i, s in enumerate(rest) if hash(s) in self._seen), default=0)
            if len(self._seen) + len(rest) > self.SEEN:
                self._seen.clear()
            self._seen.update(hash(s) for s in rest[again:])
            self.hits += len(found)
            self.misses += len(rest)
        if again:
            found += self._keep(rest[:again], self._encode(rest[:again], False))
        out = list(self._head) if add_special_tokens else []
        for ids in found:
            out += ids
        if len(found) < len(segments):
            out += self._encode([text[bounds[len(found)] :]], False)[0]
        if add_special_tokens:
            out += self._tail
        return out

    def _keep(self, segments: list[str], encoded: list[list[int]]) -> Iterable[array[int]]:
        kept = [array("I", ids) for ids in encoded]
        with self._lock:
            for segment, ids in zip(segments, kept, strict=True):
                size = _size(segment, ids)
                if segment in self._kept or size > self.cached_bytes // 16:
                    continue  # (another thread tokenized it meanwhile; or one huge)
                self._kept[segment] = ids
                self._bytes += size
            while self._bytes > self.cached_bytes and self._kept:
                self._bytes -= _size(*self._kept.popitem(last=False))
        return kept

    def fits(self, probes: Iterable[str]) -> bool:
        """Whether the tokenizer gives the same ids in segments as whole, with and without
        special tokens, for ``probes`` and for texts made of them and of words,
        punctuation, digits, spaces, accents, CJK and emoji, cut everywhere `cuts` may
        (every segment tokenized on its own, none kept)."""
        words = [
            *(p for probe in probes for p in probe.split() if p),
            "the", "Hello", "don't", "it's", "w3", "w1023", "42", "3.14", "x1",
            "naïve", "café", "世界", "🙂", "--", "...", "a,b", "(yes)", "#", "\n", "\t",
            "  ", "\r\n", "Ünïcode", "\uff41\uff42\uff43", "ÅB", "İ", "ß", "e\u0301",
        ]  # fmt: skip
        rng = random.Random(0)
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
        out = list(self._head) if add_special_tokens else []
        for ids in self._encode([text[a:b] for a, b in itertools.pairwise(bounds)], False):
            out += ids
        return out + self._tail if add_special_tokens else out
