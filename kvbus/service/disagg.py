"""Prefill/decode disaggregation (P/D): a generation request goes first to a prefill
worker, which computes its prompt's KV and hands it to its KV connector, then to a decode
worker, which loads that KV and generates, as vLLM's disaggregated-serving proxy sends it.

The prefill hop is the client's request with ``max_tokens`` 1, not streamed, and
``kv_transfer_params`` asking for a remote decode (``do_remote_decode``); the
``kv_transfer_params`` of its answer (where the KV waits: NIXL's engine id, host, port
and block ids) go into the decode hop, which is the client's request otherwise
unchanged. Both hops carry one ``X-Request-Id``. A connector that needs no parameters
(vLLM's ExampleConnector: KV in shared storage, keyed by the prompt) answers null, and
the decode hop goes without them.

The decode worker is chosen first, by load and the prefix it holds. The prefill hop is
skipped, and the decode worker computes what is left itself, when that worker already
holds nearly all of the prompt (``skip_above``, a share of the tokens a prefill could
move: the prompt's whole blocks, less the last token), when the prompt has no whole block
to move, and for a request that cannot be split (several sequences, prompt logprobs).
Each skip is
counted (``kvbus_router_pd_prefill_skipped_total{reason}``), as is each prefill hop
(``kvbus_router_pd_prefills_total{worker,code}``). A prefill worker's 4xx for the request
reaches the client (any worker would say the same); its engine's trouble (5xx, 404, 408,
429, no answer, an answer over 1 MiB) sends the hop to another prefill worker.

Roles: ``--prefill NAME=URL`` and ``--decode NAME=URL`` name them; a ``--worker`` or a
worker found on the bus takes the role its engine advertises
(`kvbus.wire.events.LoadMetrics.role`, from ``$KVBUS_ROLE``), and serves both hops
without one. Once any of the router's workers is a prefill worker, completions and chat
go through both hops, and every other request goes whole to a worker that may decode, as
does a generation no prefill worker can take (none is up, or each failed its hop). The
router sends no client's ``kv_transfer_params`` on: a client could point a decode worker
at KV of its choosing.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from typing import Any, Final, NamedTuple

import msgspec
from aiohttp import web

from kvbus.routing.router import Decision, Router
from kvbus.service.router_metrics import Metrics
from kvbus.service.served_model import Prompt
from kvbus.service.upstream import AnswerTooLarge, Upstream, WorkerBusy, WorkerUnreachable
from kvbus.service.worker_names import RANK

GENERATION_PATHS: Final = frozenset({"/v1/completions", "/v1/chat/completions"})
"""What goes through both hops: vLLM's P/D proxies send completions and chat."""
MAX_ROLES: Final = 8192
"""Advertised roles kept at most (one per worker: configured and found are bounded)."""
REMOTE_DECODE: Final = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The prefill hop's ``kv_transfer_params``, as vLLM's proxies send them."""
_WORKER_TROUBLE: Final = frozenset({404, 408, 429})
"""Statuses below 500 that say more of the prefill worker than of the request."""


class Role(str, enum.Enum):
    BOTH = "both"
    """Either hop (an aggregated engine, or a ``kv_both`` one no role was given)."""
    PREFILL = "prefill"
    DECODE = "decode"


def parse_role(text: str) -> Role | None:
    """A role as engines advertise it ("" or ``both``, ``prefill``, ``decode``); None for
    anything else."""
    if not text:
        return Role.BOTH
    try:
        return Role(text)
    except ValueError:
        return None


class WorkerRoles:
    """Each worker's role: given (``--prefill``, ``--decode``), else what its engine
    advertises, else `Role.BOTH`."""

    def __init__(self, given: dict[str, Role] | None = None) -> None:
        self.given = dict(given or {})
        self.advertised: dict[str, Role] = {}
        self._prefill = {name for name, role in self.given.items() if role is Role.PREFILL}
        """Names of the prefill workers (given or advertised): `any_prefill` in O(1)."""

    def advertise(self, source: str, text: str) -> None:
        """``source``'s load record says its role is ``text`` (network input: anything
        but a known role is ignored, and at most `MAX_ROLES` names are kept)."""
        role = parse_role(text)
        name = RANK.sub("", source)
        if role is None or name in self.given:
            return
        if name in self.advertised or len(self.advertised) < MAX_ROLES:
            self.advertised[name] = role
            if role is Role.PREFILL:
                self._prefill.add(name)
            else:
                self._prefill.discard(name)

    @property
    def any_prefill(self) -> bool:
        """Whether any worker, up or not, is a prefill worker (no P/D without)."""
        return bool(self._prefill)

    def of(self, worker: str) -> Role:
        name = RANK.sub("", worker)
        return self.given.get(name) or self.advertised.get(name) or Role.BOTH

    def not_for(self, hop: Role, workers: Iterable[str]) -> set[str]:
        """Those of ``workers`` that may not serve ``hop``."""
        return {w for w in workers if self.of(w) not in (hop, Role.BOTH)}


class _Answer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None


def _json_object(data: bytes | bytearray) -> dict[str, Any] | None:
    """A request body as a JSON object; None when it is not one (the engine says why)."""
    try:
        body = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def unsupported(body: dict[str, Any]) -> bool:
    """Whether a request cannot be split in two hops: several sequences (``n``,
    ``best_of``, beam search) would each load the one prefill's blocks, and a request
    for prompt logprobs computes its whole prompt wherever it runs (vLLM ignores an
    external cache for it)."""
    return (
        _more_than_one(body.get("n"))
        or _more_than_one(body.get("best_of"))
        or body.get("use_beam_search") is True
        or body.get("prompt_logprobs") is not None
    )


def _more_than_one(value: object) -> bool:
    return isinstance(value, int | float) and value > 1


_PREFILL_DROPS: Final = frozenset(
    {"stream_options", "echo", "logprobs", "top_logprobs", "prompt_logprobs"}
)


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill hop's body for a request's: one token, not streamed, nothing it
    would not need (logprobs, an echo of the prompt: the answer the client never sees
    stays small), asking for a remote decode."""
    sent = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    sent.update(kv_transfer_params=REMOTE_DECODE, stream=False, max_tokens=1)
    if "max_completion_tokens" in sent:
        sent["max_completion_tokens"] = 1
    if "min_tokens" in sent:
        sent["min_tokens"] = 0  # over max_tokens, vLLM refuses the request
    return msgspec.json.encode(sent)


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> bytes | None:
    """The decode hop's body: the request's, with the prefill's ``kv_transfer_params``
    and never the client's own (they would point the decode worker at KV of the
    client's choosing). None: the client's body as it came (it named none, and the
    prefill answered none)."""
    if params is None and "kv_transfer_params" not in body:
        return None
    sent = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params is not None:
        sent["kv_transfer_params"] = params
    return msgspec.json.encode(sent)


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill's answer (None: none, or not JSON)."""
    try:
        return msgspec.json.decode(answer, type=_Answer).kv_transfer_params
    except (msgspec.DecodeError, RecursionError):
        return None


class Prefilled(NamedTuple):
    """What the prefill hop left for the decode hop."""

    body: bytes | None = None
    """The decode hop's body (None: the client's, unchanged)."""
    refused: web.StreamResponse | None = None
    """The prefill worker's error for the request, to give the client as it is."""
    moved: bool = False
    """The prompt's KV was computed on a prefill worker (the decode worker loads it)."""


class PrefillDecode:
    """Sends a request's prefill hop (`prefill`) for the decode worker already chosen."""

    def __init__(
        self,
        roles: WorkerRoles,
        router: Router,
        upstream: Upstream,
        metrics: Metrics,
        skip_above: float = 0.9,
    ) -> None:
        self.roles = roles
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.skip_above = skip_above
        """Share of the prompt's movable tokens (`_movable`): a decode worker holding
        at least that many goes without the prefill hop."""

    def active(self) -> bool:
        """Whether the fleet is disaggregated: some worker, up or not, is a prefill
        worker. Then every request but a prefill hop goes to a worker that may decode,
        and a generation whose prefill hop no prefill worker can take (none is up, or
        each failed it) goes there whole, counted (``no_prefill_worker``)."""
        return self.roles.any_prefill

    def has_prefill_hop(self, path: str, prompt: Prompt) -> bool:
        """Whether a request to ``path`` goes through both hops (while `active`): a
        completion or chat the router could read (one it could not, too large to
        tokenize, say, goes whole to a decode worker, counted: ``untokenized``)."""
        if path not in GENERATION_PATHS:
            return False
        if not prompt.tokens:
            self.metrics.pd_skipped.labels("untokenized").inc()
            return False
        return True

    def decode_excluded(self) -> set[str]:
        return self.roles.not_for(Role.DECODE, self.router.eligible())

    async def prefill(
        self,
        request: web.Request,
        data: bytes | bytearray,
        prompt: Prompt,
        decode: Decision,
        headers: dict[str, str],
        deadline: float | None = None,
    ) -> Prefilled:
        """The prefill hop of a request whose decode goes to ``decode``'s worker;
        ``deadline``: the seconds left to its last token (its prefill worker is held to
        them as to the first token)."""
        body = _json_object(data)
        if body is None:
            return self._skipped("unreadable", None)  # the engine says what is wrong
        movable = self._movable(decode)
        if not movable:
            return self._skipped("short", body)  # no whole block to move
        if decode.predicted_cached_tokens >= self.skip_above * movable:
            return self._skipped("held", body)
        if unsupported(body):
            return self._skipped("unsupported", body)
        sent = prefill_body(body)
        failed: set[str] = set()
        while True:
            # The roles of the workers that may get traffic now (one may have joined).
            tried = failed | self.roles.not_for(Role.PREFILL, self.router.eligible())
            tried.add(decode.worker)  # it would compute the prompt itself: no hop
            chosen = self.router.route(
                prompt.tokens,
                prompt.lora,
                prompt.extra_keys,
                exclude=tried,
                max_tokens=1,
                ignores_eos=True,
                deadline=deadline,
            )
            if chosen is None or chosen.shed:
                return self._skipped("no_prefill_worker", body)
            try:
                started = time.perf_counter()
                status, answer = await self.upstream.exchange(request, sent, chosen, headers)
            except (WorkerBusy, AnswerTooLarge) as error:
                failed.add(chosen.worker)  # not its fault: it stays up for the others
                if isinstance(error, WorkerBusy):
                    self.metrics.busy.labels(chosen.worker).inc()
                continue
            except WorkerUnreachable as error:
                failed.add(chosen.worker)
                self.router.mark_down(chosen.worker, self.upstream.down_for)
                self.upstream.say_unreachable(chosen.worker, str(error))
                continue
            finally:
                self.router.finished(chosen)
            self.metrics.pd_prefills.labels(chosen.worker, str(status)).inc()
            if status != 200:
                if 400 <= status < 500 and status not in _WORKER_TROUBLE:
                    # The request itself is wrong (vLLM's error says why): any worker
                    # would refuse it the same.
                    return Prefilled(refused=_error_response(status, answer))
                failed.add(chosen.worker)  # its engine's trouble: another, or none
                continue
            self.metrics.pd_prefill_seconds.observe(time.perf_counter() - started)
            self.router.prefilled_elsewhere(decode)
            decode.predicted_cached_tokens = max(decode.predicted_cached_tokens, movable)
            return Prefilled(body=decode_body(body, transfer_params(answer)), moved=True)

    def _movable(self, decision: Decision) -> int:
        """Tokens of the prompt's KV a prefill can leave for the decode: its whole
        blocks, less the last token (vLLM always computes one)."""
        block = self.router.index.block_size or 0
        return max(decision.prompt_tokens - 1, 0) // block * block if block else 0

    def _skipped(self, reason: str, body: dict[str, Any] | None) -> Prefilled:
        """No prefill hop: the request goes whole to its decode worker (without any
        ``kv_transfer_params`` its client put in it)."""
        self.metrics.pd_skipped.labels(reason).inc()
        return Prefilled(body=None if body is None else decode_body(body, None))


def _error_response(status: int, answer: bytes) -> web.Response:
    """A prefill worker's refusal as the client gets it (vLLM's error shape, its JSON)."""
    return web.Response(status=status, body=answer, content_type="application/json")
