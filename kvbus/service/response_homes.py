"""Where each Responses API response was made: vLLM keeps a stored response (and the
conversation it ends) in the memory of the engine that made it, so a request that names
it (``previous_response_id``, ``GET /v1/responses/{id}``, ``.../cancel``) must go to that
engine; anywhere else it is a 404."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Final

_ID: Final = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,128})"')
_PREVIOUS: Final = re.compile(rb'"previous_response_id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,128})"')
_PATH_ID: Final = re.compile(r"^/v1/responses/(resp_[A-Za-z0-9_-]{1,128})(?:/cancel)?$")
MAX_HOMES: Final = 65536
"""Responses remembered, the oldest forgotten first (each about 200 bytes)."""


class ResponseHomes:
    """Response ids and the workers that made them: at most ``limit``, least recently
    used forgotten first; every operation O(1) in the number held."""

    def __init__(self, limit: int = MAX_HOMES) -> None:
        self.limit = limit
        self._homes: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def answered(self, worker: str, head: bytes) -> None:
        """A worker answered a Responses request: ``head``, the start of its answer (a
        whole response's JSON or a stream's first event, ``response.created``), names
        the response's id. The first ``"id": "resp_..."`` in it is the response's: both
        shapes put it before any output item's."""
        found = _ID.search(head)
        if found is None:
            return
        response_id = found.group(1).decode()
        self._homes[response_id] = worker
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)

    def of_body(self, raw: bytes | bytearray) -> str | None:
        """The worker that made the response a request body names in its
        ``previous_response_id`` (None: none named, or not known here). Found by a
        bounded pattern, not by parsing the body: one pass, no nesting to recurse into
        (the engine parses it and says what is wrong with it)."""
        found = _PREVIOUS.search(raw)
        return self._home(found.group(1).decode()) if found else None

    def of_path(self, path: str) -> str | None:
        """The worker that made the response a path names (``/v1/responses/{id}``,
        ``.../cancel``)."""
        found = _PATH_ID.match(path)
        return self._home(found.group(1)) if found else None

    def _home(self, response_id: str) -> str | None:
        worker = self._homes.get(response_id)
        if worker is not None:
            self._homes.move_to_end(response_id)
        return worker
