"""Retrying a transport call forever, with jittered exponential backoff (tenacity)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import tenacity


def retry_forever(
    what: str, on_failure: Callable[[], None], logger: logging.Logger
) -> tenacity.AsyncRetrying:
    """``async for attempt in retry_forever(...): with attempt: ...`` retries any
    exception after 0-2 s of backoff; each failure calls ``on_failure`` (a counter) and
    logs a warning naming ``what`` failed."""

    def before_sleep(state: tenacity.RetryCallState) -> None:
        on_failure()
        error = state.outcome.exception() if state.outcome else None
        logger.warning("kvbus: %s failed (%r); retrying", what, error)

    return tenacity.AsyncRetrying(
        wait=tenacity.wait_random_exponential(multiplier=0.02, max=2.0),
        retry=tenacity.retry_if_exception_type(Exception),
        before_sleep=before_sleep,
    )
