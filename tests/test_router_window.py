"""The router's predictions on real vLLM CPU engines serving hybrid models:

- ``window``: a tiny dummy-weight Llama whose even layers attend to a 64-token sliding
  window (vLLM keeps a sliding-window KV cache group beside the full-attention one);
- ``linear``: a tiny Qwen3-Next, three linear-attention (GDN) layers and one
  full-attention layer (vLLM keeps a mamba group per linear layer, and picks a block
  size of 96 tokens to match their state's pages).

Such an engine reuses a cached prefix only where its other groups allow: the window
group must still hold the window of blocks before the prefix's end, a mamba group the
state saved at exactly that boundary, and both keep few (near each request's last
token). So a conversation's next turn finds its history cached, while another request
sharing only the system prompt may find nothing, although the full-attention group
holds that prompt. What the router predicts must be what the engine reports, for both."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster import (
    RouterProcess,
    VllmServer,
    engine_behind_router,
    hybrid_conversations,
    make_model,
)

from .servers import NatsServer

WINDOW = 64  # tokens: two blocks of 32


@pytest.fixture(scope="module", params=["window", "linear"])
def hybrid(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    nats_server: NatsServer,
) -> Iterator[tuple[VllmServer, RouterProcess]]:
    directory = tmp_path_factory.mktemp(request.param)
    model = directory / "model"
    model.mkdir()
    if request.param == "window":
        make_model(model, sliding_window=WINDOW)
    else:
        make_model(model, linear_attention=True)
    # A few hundred blocks' worth of tokens in all, shared by the groups: the workload
    # evicts.
    engine = VllmServer(
        directory, model, request.param, nats_server.url,
        blocks=80 if request.param == "window" else 40,
    )  # fmt: skip
    with engine_behind_router(engine, nats_server.url) as router:
        yield engine, router


def test_predictions_match_a_hybrid_engine(
    hybrid: tuple[VllmServer, RouterProcess],
) -> None:
    engine, router = hybrid
    seen = hybrid_conversations(engine, router)
    # The rule: a router matching the full-attention group alone predicts the system
    # prompt for a sibling the engine finds nothing for (it holds the system prompt's
    # blocks in full). Most of those must be predicted as found: nothing.
    missed = [s.predicted for s in seen if s.kind == "sibling" and s.reported == 0]
    assert missed and sum(p == 0 for p in missed) >= 0.5 * len(missed), seen
    # Every request exact, but those routed while the engine's events of an earlier
    # one were still on their way (``late``: the router had not applied them when it
    # routed). On a loaded machine (a full CI run) that was 2-5 of 32 on the mamba
    # model; the predictions made from every event sent before must all be exact.
    wrong = [(i, s) for i, s in enumerate(seen) if s.predicted != s.reported]
    assert all(s.late for _, s in wrong), wrong
    # And few late ones: the soak (bench/soak_hybrid_predictions.py) had at most 5 of
    # 32 wrong a round with two busy loops beside the engine.
    assert len(wrong) <= 0.25 * len(seen), wrong
    # Turns found their history.
    assert sum(s.reported > 0 for s in seen if s.kind == "turn") >= 8, seen
