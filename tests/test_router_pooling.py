"""The router in front of a real vLLM pooling engine (a dummy-weight embedding model on
CPU): what it does not route by prompt passes through by load, vLLM's answers unchanged."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster import RouterProcess, VllmServer, engine_behind_router, make_model
from cluster import post_json as post

from .servers import NatsServer


@pytest.fixture(scope="module")
def pooling(
    tmp_path_factory: pytest.TempPathFactory, nats_server: NatsServer
) -> Iterator[tuple[VllmServer, RouterProcess]]:
    directory = tmp_path_factory.mktemp("pooling")
    model = directory / "model"
    model.mkdir()
    make_model(model)
    engine = VllmServer(
        directory, model, "embed", nats_server.url,
        extra_args=["--runner", "pooling", "--convert", "embed", "--no-enable-prefix-caching"],
    )  # fmt: skip
    with engine_behind_router(engine, nats_server.url) as router:
        yield engine, router


def test_embeddings_and_pooling_pass_through_a_pooling_engine(
    pooling: tuple[VllmServer, RouterProcess],
) -> None:
    engine, router = pooling
    model = str(engine.model)
    for path, body in (
        ("/v1/embeddings", {"model": model, "input": ["w5 w6 w7", "w8 w9"]}),
        ("/pooling", {"model": model, "input": "w5 w6 w7"}),
        ("/tokenize", {"model": model, "prompt": "w5 w6 w7"}),
    ):
        status, headers, routed = post(f"{router.url}{path}", body)
        direct = post(f"{engine.url}{path}", body)
        assert (status, direct[0], headers["x-kvbus-worker"]) == (200, 200, "embed/dp0"), (
            path,
            routed,
        )
        for answer in (routed, direct[2]):  # ids and times differ; the rest is the same
            if isinstance(answer, dict):
                answer.pop("id", None)
                answer.pop("created", None)
        assert routed == direct[2], path
        if path == "/v1/embeddings":
            assert [len(d["embedding"]) > 0 for d in routed["data"]] == [True, True]
    assert len(routed["tokens"]) == 3
