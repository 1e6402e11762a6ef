"""Where each Responses API response was made (kvbus.service.response_homes): read from
the start of the engine's answer, looked up from a body or a path, bounded."""

from __future__ import annotations

import json

from kvbus.service.response_homes import ResponseHomes


def test_a_response_is_found_where_it_was_made_from_a_whole_answer_or_a_stream() -> None:
    homes = ResponseHomes()
    whole = json.dumps({"id": "resp_abc", "object": "response", "output": [{"id": "msg_1"}]})
    homes.answered("a/dp0", whole.encode())
    stream = (
        b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_def"'
    )
    homes.answered("b/dp0", stream)
    assert homes.of_body(json.dumps({"previous_response_id": "resp_abc"}).encode()) == "a/dp0"
    assert homes.of_path("/v1/responses/resp_def") == "b/dp0"
    assert homes.of_path("/v1/responses/resp_def/cancel") == "b/dp0"


def test_what_names_no_known_response_has_no_home() -> None:
    homes = ResponseHomes()
    homes.answered("a/dp0", b'{"id": "resp_abc"}')
    for body in (
        b'{"input": "hi"}',
        b'{"previous_response_id": "resp_other"}',
        b'{"previous_response_id": 7}',
        b'["previous_response_id"]',
        b'{"previous_response_id": ',
        b'{"previous_response_id": "resp_' + b"x" * 10_000 + b'"}',
    ):
        assert homes.of_body(body) is None, body
    for path in ("/v1/responses", "/v1/responses/resp_abc/input_items", "/v1/responses/x"):
        assert homes.of_path(path) is None, path
    deep = b'{"previous_response_id": "resp_abc", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert homes.of_body(deep) == "a/dp0"  # found without parsing: no nesting to recurse
    homes.answered("a/dp0", b'{"id": "cmpl-1"}')  # not a response: nothing kept
    homes.answered("a/dp0", b'{"id": "resp_' + b"x" * 10_000 + b'"}')  # forged: too long
    assert len(homes) == 1


def test_the_homes_are_bounded_and_the_least_recently_used_go_first() -> None:
    homes = ResponseHomes(limit=3)
    for n in range(3):
        homes.answered(f"w{n}", f'{{"id": "resp_{n}"}}'.encode())
    assert homes.of_path("/v1/responses/resp_0") == "w0"  # used: kept over resp_1
    homes.answered("w3", b'{"id": "resp_3"}')
    assert len(homes) == 3
    assert homes.of_path("/v1/responses/resp_1") is None
    assert [homes.of_path(f"/v1/responses/resp_{n}") for n in (0, 2, 3)] == ["w0", "w2", "w3"]
