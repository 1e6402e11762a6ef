"""examples/nats_router.py in front of two real vLLM CPU servers over NATS (JetStream),
run as operators run it: its own process, ``--worker NAME=URL``, ``--policy``.

Each engine's KV cache (40 blocks) holds 5 of the 8 tenants' prefixes (8 blocks each),
so the policy decides how much is found cached; what counts is what the engines report
(``usage.prompt_tokens_details.cached_tokens`` and their Prometheus counters)."""

from __future__ import annotations

import json
import os
import random
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import RouterProcess, free_port, wait_listening
from cluster import post_json as post
from router_demo import Cluster, workload

WORKERS = {"a/dp0", "b/dp0"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("router-cluster"), blocks=40)
    # vLLM keeps Responses API responses (previous_response_id) only when asked to.
    store, os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = (
        os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE"),
        "1",
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if store is None:
            del os.environ["VLLM_ENABLE_RESPONSES_API_STORE"]
        else:
            os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = store


@pytest.fixture(scope="module")
def router(cluster: Cluster) -> Iterator[RouterProcess]:
    process = RouterProcess(cluster.directory, cluster.workers, "kv", cluster.nats.url)
    process.launch()
    try:
        process.wait_ready(2, timeout=60)
        yield process
    finally:
        process.stop()


async def test_kv_policy_doubles_the_engines_hit_rate_and_predicts_it(cluster: Cluster) -> None:
    requests = workload(seed=7, tenants=8, rounds=16)  # the demo's size
    kv = await cluster.run_policy("kv", requests, concurrency=2)
    round_robin = await cluster.run_policy("round_robin", requests, concurrency=2)

    for row in (kv, round_robin):
        assert len(row.ok) == len(requests), [r.status for r in row.results]
        assert {r.worker for r in row.ok} == WORKERS
        # The engines' own counters tell the same story as the responses' usage.
        assert row.engine_hit_rate == pytest.approx(row.hit_rate, abs=0.02)
    assert kv.hit_rate >= 2 * round_robin.hit_rate, (kv.hit_rate, round_robin.hit_rate)
    # What the router believed each engine held is what each engine found.
    assert kv.predicted_exactly >= 0.95, [(r.predicted, r.cached_tokens) for r in kv.ok]


def test_responses_pass_through_unchanged(cluster: Cluster, router: RouterProcess) -> None:
    model = str(cluster.model)
    # 9 full blocks: enough that holding them outweighs the worker still looking busy
    # from the request just before (its idle record may not have arrived yet).
    body = {"model": model, "prompt": list(range(5, 305)), "max_tokens": 3, "ignore_eos": True}
    status, headers, routed = post(f"{router.url}/v1/completions", body)
    assert status == 200 and headers["x-kvbus-worker"] in WORKERS
    assert routed["usage"]["prompt_tokens"] == 300  # token ids, as vLLM takes them
    base = cluster.workers[headers["x-kvbus-worker"].split("/")[0]]
    _, _, direct = post(f"{base}/v1/completions", body)
    assert set(routed) == set(direct) and routed["usage"].keys() == direct["usage"].keys()

    # Streamed: the chunks pass through, and the usage on the last one is counted.
    stream = body | {"stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(
        f"{router.url}/v1/completions",
        json.dumps(stream).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    usage = json.loads(events[-2][6:])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 288  # the same prompt again

    with urllib.request.urlopen(f"{router.url}/v1/models", timeout=10) as response:
        assert json.load(response)["data"][0]["id"] == model
    with urllib.request.urlopen(f"{router.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert "kvbus_router_requests_total" in text and "kvbus_router_eligible_workers 2.0" in text
    reported = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvbus_router_reported_cached_tokens_sum")
    )
    assert reported >= 288


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(4, 1024)}" for _ in range(n))


def test_the_responses_and_anthropic_apis_route_by_prompt_and_predict_the_cache(
    cluster: Cluster, router: RouterProcess
) -> None:
    model = str(cluster.model)
    responses = {"model": model, "instructions": words(1, 20), "input": words(2, 200)}
    responses["max_output_tokens"] = 3
    anthropic = {
        "model": model,
        "max_tokens": 3,
        "system": [{"type": "text", "text": words(3, 20)}],
    }
    anthropic["messages"] = [{"role": "user", "content": [{"type": "text", "text": words(4, 200)}]}]
    for path, body, cached_of in (
        ("/v1/responses", responses, lambda r: r["usage"]["input_tokens_details"]["cached_tokens"]),
        ("/v1/messages", anthropic, lambda r: r["usage"]["cache_read_input_tokens"]),
    ):
        status, first, _ = post(f"{router.url}{path}", body)
        assert status == 200 and first["x-kvbus-worker"] in WORKERS
        status, again, answer = post(f"{router.url}{path}", body)
        assert status == 200 and again["x-kvbus-worker"] == first["x-kvbus-worker"], path
        # The router read the prompt as vLLM built it: what it expected found is what was.
        assert cached_of(answer) >= 6 * 16, (path, answer["usage"])
        assert int(again["x-kvbus-predicted-cached-tokens"]) == cached_of(answer), path


def test_salted_prompts_are_predicted_as_the_engine_keys_them(
    cluster: Cluster, router: RouterProcess
) -> None:
    """vLLM hashes a request's ``cache_salt`` into its first block: the same prompt under
    another salt (or none) shares nothing with it. The router keys it so: what it
    predicts is what the engine finds, salted, unsalted and salted otherwise."""
    model = str(cluster.model)
    prompt = {"model": model, "prompt": words(300, 200), "max_tokens": 2}
    seen = []
    for salt in ("tenant-a", "tenant-a", None, "tenant-b", "tenant-b", None):
        body = prompt if salt is None else prompt | {"cache_salt": salt}
        status, headers, answer = post(f"{router.url}/v1/completions", body)
        assert status == 200, answer
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        seen.append((salt, int(headers["x-kvbus-predicted-cached-tokens"]), cached))
    assert [predicted == cached for _, predicted, cached in seen] == [True] * 6, seen
    # Each salt's first request found nothing of the others'; its second found its own.
    assert [cached > 0 for _, _, cached in seen] == [False, True, False, False, True, True]


def test_a_stored_response_is_followed_where_it_was_made(
    cluster: Cluster, router: RouterProcess
) -> None:
    """vLLM keeps a response (and its conversation) on the engine that made it: a request
    that names it anywhere else is a 404. Each new conversation here would go to either
    engine by its prompt; its follow-ups go where it started."""
    model = str(cluster.model)
    homes = set()
    for seed in range(6):
        body = {"model": model, "input": words(100 + seed, 120), "max_output_tokens": 2}
        status, headers, made = post(f"{router.url}/v1/responses", body)
        assert status == 200 and made["id"].startswith("resp_"), made
        home = headers["x-kvbus-worker"]
        homes.add(home)
        follow = {"model": model, "input": words(200 + seed, 120), "max_output_tokens": 2}
        status, headers, answer = post(
            f"{router.url}/v1/responses", follow | {"previous_response_id": made["id"]}
        )
        assert (status, headers["x-kvbus-worker"]) == (200, home), answer
        with urllib.request.urlopen(f"{router.url}/v1/responses/{made['id']}", timeout=30) as r:
            assert r.headers["x-kvbus-worker"] == home and json.load(r)["id"] == made["id"]
    assert homes == WORKERS  # both engines made some: the follow-ups did not just land there


def test_the_rest_of_vllms_api_passes_through(cluster: Cluster, router: RouterProcess) -> None:
    """/tokenize, /detokenize, /version, and what this engine does not serve (embeddings on
    a generating model): vLLM's own answer, through the router."""
    model = str(cluster.model)
    base = cluster.workers["a"]
    for path, body in (
        ("/tokenize", {"model": model, "prompt": "w5 w6 w7"}),
        ("/detokenize", {"model": model, "tokens": [5, 6, 7]}),
        ("/v1/embeddings", {"model": model, "input": "w5 w6"}),
    ):
        routed, direct = post(f"{router.url}{path}", body), post(f"{base}{path}", body)
        assert routed[0] == direct[0] and routed[1]["x-kvbus-worker"] in WORKERS, path
        assert routed[2] == direct[2], path
    with urllib.request.urlopen(f"{router.url}/version", timeout=10) as response:
        assert "version" in json.load(response)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"model": "x", "prompt": ', id="invalid-json"),
        pytest.param({"model": "no-such-model", "prompt": "w5 w6"}, id="unknown-model"),
        pytest.param(None, id="prompt-too-long"),
        pytest.param({"prompt": "w5", "max_tokens": -1}, id="bad-parameter"),
    ],
)
def test_bad_input_gets_vllms_own_answer(
    cluster: Cluster, router: RouterProcess, body: bytes | dict[str, Any] | None
) -> None:
    model = str(cluster.model)
    if body is None:
        body = {"model": model, "prompt": " ".join(["w7"] * 600), "max_tokens": 4}
    elif isinstance(body, dict):
        body = {"model": model} | body
    routed = post(f"{router.url}/v1/completions", body)
    direct = post(f"{cluster.servers[0].url}/v1/completions", body)
    assert 400 <= routed[0] < 500
    assert (routed[0], routed[2]) == (direct[0], direct[2])
    # ... and the router keeps serving.
    ok = post(f"{router.url}/v1/completions", {"model": model, "prompt": "w5 w6", "max_tokens": 1})
    assert ok[0] == 200


def test_no_worker_alive_is_503_in_vllms_shape(cluster: Cluster, tmp_path: Path) -> None:
    ghost = RouterProcess(
        tmp_path, {"ghost": f"http://127.0.0.1:{free_port()}"}, "kv", cluster.nats.url
    )
    ghost.launch()
    try:
        assert ghost.process is not None
        wait_listening(ghost.port, ghost.process, "router", timeout=60)
        status, _, body = post(f"{ghost.url}/v1/completions", {"model": "m", "prompt": "w5"})
        assert status == 503
        assert body["error"]["code"] == 503 and body["error"]["type"] and body["error"]["message"]
        status, _, _ = post(f"{ghost.url}/v1/completions", {"model": "m", "prompt": "w5"})
        assert status == 503  # still serving
    finally:
        ghost.stop()


def test_an_unreachable_worker_is_skipped(cluster: Cluster, tmp_path: Path) -> None:
    """Worker ``a`` publishes load but the router's URL for it refuses connections: its
    requests go to ``b`` and ``a`` gets nothing more while marked down."""
    workers = cluster.workers | {"a": f"http://127.0.0.1:{free_port()}"}
    process = RouterProcess(tmp_path, workers, "round_robin", cluster.nats.url)
    process.launch()
    try:
        process.wait_ready(2, timeout=60)
        body = {"model": str(cluster.model), "prompt": "w5 w6", "max_tokens": 1}
        answers = [post(f"{process.url}/v1/completions", body) for _ in range(6)]
        assert [a[0] for a in answers] == [200] * 6
        assert {a[1]["x-kvbus-worker"] for a in answers} == {"b/dp0"}
    finally:
        process.stop()


def test_every_worker_unreachable_is_503_and_serving_goes_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Both engines publish load, but neither URL answers (their HTTP servers gone): each
    refusal marks that worker down, then the router says 503, and still answers /health."""
    workers = {name: f"http://127.0.0.1:{free_port()}" for name in cluster.workers}
    process = RouterProcess(tmp_path, workers, "kv", cluster.nats.url)
    process.launch()
    try:
        process.wait_ready(2, timeout=60, tokenizer=False)  # both alive by their metrics
        body = {"model": str(cluster.model), "prompt": "w5 w6", "max_tokens": 1}
        status, _, answer = post(f"{process.url}/v1/completions", body)
        assert status == 503 and answer["error"]["code"] == 503
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{process.url}/health", timeout=10)
        assert health.value.code == 503  # nobody eligible while marked down
    finally:
        process.stop()


@pytest.mark.parametrize("tokens", [[5, -1, 7], [5, 2**32, 7], [5, 2**40, 7], [5, 1024, 7]])
def test_token_ids_no_engine_could_take_get_vllms_400(
    cluster: Cluster, router: RouterProcess, tokens: list[int]
) -> None:
    body = {"model": str(cluster.model), "prompt": tokens, "max_tokens": 1}
    routed = post(f"{router.url}/v1/completions", body)
    direct = post(f"{cluster.servers[0].url}/v1/completions", body)
    assert routed[0] == direct[0] == 400
    assert routed[2] == direct[2]


def test_ready_at_once_after_a_restart_with_the_index_complete(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`kvbus router`, started while engine b already holds a prompt: when /health says
    ready, the index has b's blocks and both workers' load (from the metrics stream's
    recent past), so the first request goes to b and its cached tokens are predicted
    exactly; the same after a restart."""
    prompt = " ".join(f"w{i}" for i in range(400, 560))  # 5 blocks
    holder = cluster.servers[1]
    holder.complete(prompt)
    for attempt in range(2):
        process = RouterProcess(tmp_path, cluster.workers, "kv", cluster.nats.url, cli=True)
        process.launch()
        try:
            process.wait_ready(2, timeout=60)
            health = process.health()
            assert health["ready"] and sorted(health["eligible"]) == sorted(WORKERS)
            body = {"model": str(cluster.model), "prompt": prompt, "max_tokens": 1}
            status, headers, answer = post(f"{process.url}/v1/completions", body)
            assert status == 200, attempt
            assert headers["x-kvbus-worker"] == f"{holder.source}/dp0"
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert int(headers["x-kvbus-predicted-cached-tokens"]) == cached == 128
        finally:
            process.stop()


def test_routing_accuracy_is_a_live_metric(cluster: Cluster, router: RouterProcess) -> None:
    def series() -> dict[str, float]:
        text = urllib.request.urlopen(f"{router.url}/metrics", timeout=10).read().decode()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kvbus_router_") and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                outcome = re.search(r'outcome="(\w+)"', line)
                key = f"{name}:{outcome.group(1)}" if outcome else name
                totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    before = series()
    prompt = " ".join(f"w{i}" for i in range(600, 760))
    body = {"model": str(cluster.model), "prompt": prompt, "max_tokens": 1}
    answers = [post(f"{router.url}/v1/completions", body) for _ in range(3)]
    after = series()
    reported = sum(a[2]["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    predicted = sum(int(a[1]["x-kvbus-predicted-cached-tokens"]) for a in answers)
    exact = sum(
        int(a[1]["x-kvbus-predicted-cached-tokens"])
        == a[2]["usage"]["prompt_tokens_details"]["cached_tokens"]
        for a in answers
    )

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("kvbus_router_reported_cached_tokens_sum") == reported >= 2 * 128
    assert grew("kvbus_router_predicted_cached_tokens_sum") == predicted
    assert grew("kvbus_router_predicted_cached_tokens_count") == 3
    assert grew("kvbus_router_predictions_total:exact") == exact
    assert sum(grew(f"kvbus_router_predictions_total:{o}") for o in ("exact", "over", "under")) == 3
    assert grew("kvbus_router_prediction_error_tokens_sum") == reported - predicted
    # Regret: the kv policy sent each where the most of it was held (the second and
    # third found their predecessors' blocks), so it gave up nothing.
    assert grew("kvbus_router_best_cached_tokens_sum") == predicted
    assert grew("kvbus_router_regret_tokens_count") == 6  # against predicted and reported
    assert grew("kvbus_router_regret_tokens_sum") == predicted - reported


def test_prompts_sent_as_token_ids_get_vllms_own_answer(cluster: Cluster, tmp_path: Path) -> None:
    """By default (``--send-token-ids``) the router checks each engine's /tokenize against
    its tokenizer and then sends a completion's text prompt as its ids; the engine takes
    the prompt it would have tokenized (same ids, same count, the same cached blocks
    found next time), and an ``echo`` goes as text."""
    process = RouterProcess(tmp_path, cluster.workers, "kv", cluster.nats.url)
    process.launch()

    def sent_as_ids() -> float:
        with urllib.request.urlopen(f"{process.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        counted = re.search(r"^kvbus_router_prompts_sent_as_ids_total (\S+)$", text, re.M)
        assert counted is not None
        return float(counted.group(1))

    try:
        process.wait_ready(2, timeout=60)
        both = "sent as token ids (2 engines checked)"
        process.wait(lambda: process.health()["token_ids"] == both, 30, 0.2)
        prompt = words(21, 200)  # 6 full blocks
        body = {"model": str(cluster.model), "prompt": prompt, "max_tokens": 2}
        body |= {"ignore_eos": True, "return_token_ids": True}
        status, headers, routed = post(f"{process.url}/v1/completions", body)
        assert status == 200, routed
        base = cluster.workers[headers["x-kvbus-worker"].split("/")[0]]
        _, _, direct = post(f"{base}/v1/completions", body)
        assert routed["choices"][0]["prompt_token_ids"] == direct["choices"][0]["prompt_token_ids"]
        assert routed["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"] == 200
        again = post(f"{process.url}/v1/completions", body)
        assert again[1]["x-kvbus-worker"] == headers["x-kvbus-worker"]
        assert again[2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
        assert sent_as_ids() == 2
        echo = {"model": str(cluster.model), "prompt": prompt, "max_tokens": 1, "echo": True}
        status, _, echoed = post(f"{process.url}/v1/completions", echo)
        assert status == 200 and echoed["choices"][0]["text"].startswith(prompt)
        assert sent_as_ids() == 2
        # Long prompts sharing a prefix (over 2,048 characters: tokenized in segments,
        # kept once seen again): the engine still takes the ids it would have made.
        prefix = words(22, 500)
        for tail in ("w5 w6 w7", "w8 w9", "w10"):
            long = {"model": str(cluster.model), "prompt": f"{prefix} {tail}", "max_tokens": 1}
            long["return_token_ids"] = True
            status, headers, routed = post(f"{process.url}/v1/completions", long)
            assert status == 200, routed
            base = cluster.workers[headers["x-kvbus-worker"].split("/")[0]]
            _, _, direct = post(f"{base}/v1/completions", long)
            ids = routed["choices"][0]["prompt_token_ids"]
            assert ids == direct["choices"][0]["prompt_token_ids"] and len(ids) > 500
        assert sent_as_ids() == 5
        with urllib.request.urlopen(f"{process.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        kept = re.search(
            r'^kvbus_router_prompt_segments_total\{source="cache"\} (\S+)$', text, re.M
        )
        assert kept is not None and float(kept.group(1)) >= 2  # the third's prefix
    finally:
        process.stop()


def test_a_request_that_would_end_past_its_deadline_is_shed(
    cluster: Cluster, router: RouterProcess
) -> None:
    """The router learns each engine's seconds per output token from streamed answers
    that carry usage (a real vLLM's); a request whose output at that pace would end past
    its X-Kvbus-Deadline is answered 503 at once, and a shorter one goes."""
    url = f"{router.url}/v1/completions"

    def send(body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes]:
        data = json.dumps({"model": str(cluster.model), **body}).encode()
        request = urllib.request.Request(url, data, {"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    stream = {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    status, answer = send({"prompt": words(300, 48), "max_tokens": 16, **stream}, {})
    assert status == 200 and b'"completion_tokens":16' in answer.replace(b" ", b"")
    text = urllib.request.urlopen(f"{router.url}/metrics", timeout=10).read().decode()
    learned = [
        float(m.group(1))
        for m in re.finditer(r"^kvbus_router_seconds_per_output_token\{[^}]*\} (\S+)$", text, re.M)
    ]
    assert learned and min(learned) > 0
    per_token = min(learned)  # the chosen engine's, or the median standing in: no less
    deadline = max(2.0, 50 * per_token)
    tokens = int(2 * deadline / per_token) + 2  # twice the deadline at the least pace
    headers = {"X-Kvbus-Deadline": f"{deadline:.3f}"}
    prompt = {"prompt": words(320, 48), "ignore_eos": True}
    status, refused = send({**prompt, "max_tokens": tokens}, headers)
    assert status == 503, refused
    message = json.loads(refused)["error"]["message"]
    assert "to the last token" in message and "left of the request's deadline" in message
    status, answer = send({**prompt, "max_tokens": 2}, headers)
    assert status == 200, answer
    status, bad = send({**prompt, "max_tokens": 2}, {"X-Kvbus-Deadline": "soon"})
    assert status == 400 and b"X-Kvbus-Deadline" in bad
    text = urllib.request.urlopen(f"{router.url}/metrics", timeout=10).read().decode()
    assert re.search(r'^kvbus_router_shed_requests_total\{limit="deadline"\} 1\.0$', text, re.M)


def test_a_router_with_no_worker_routes_to_the_engines_the_bus_tells_of(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Each engine's load records say where it serves (vLLM's own --host/--port): a
    router given no --worker routes to both, refuses an advertised URL outside its
    --discover-hosts, and stops routing to an engine that stops. Last in this module: it
    stops engine b."""
    fenced = RouterProcess(
        tmp_path / "fenced", {}, "round_robin", cluster.nats.url, ["--discover-hosts", "10.0.0.0/8"]
    )
    router = RouterProcess(tmp_path / "open", {}, "round_robin", cluster.nats.url)
    for process in (fenced, router):
        process.data_dir.mkdir()
        process.launch()
    try:
        router.wait_ready(2, timeout=60)
        refused = "is refused (host '127.0.0.1' not in --discover-hosts)"
        fenced.wait(lambda: refused in fenced.log_tail(), timeout=30)
        assert fenced.health()["eligible"] == []  # the same records, refused
        body = {"model": str(cluster.model), "prompt": words(400, 40), "max_tokens": 2}
        answers = [post(f"{router.url}/v1/completions", body) for _ in range(6)]
        assert {a[1]["x-kvbus-worker"] for a in answers if a[0] == 200} == WORKERS
        next(s for s in cluster.servers if s.source == "b").stop()
        after = [post(f"{router.url}/v1/completions", body) for _ in range(6)]
        assert [(a[0], a[1]["x-kvbus-worker"]) for a in after] == [(200, "a/dp0")] * 6
        assert router.health()["eligible"] == ["a/dp0"]
    finally:
        fenced.stop()
        router.stop()
