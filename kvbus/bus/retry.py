"""Retrying a transport call forever, with jittered exponential backoff (tenacity)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import tenacity

from kvbus.config import redact_text
from kvbus.logs import LimitedLog
from kvbus.shutdown import raise_if_cancelling
from kvbus.transports import BackendUnusable


def retry_forever(
    what: str, on_failure: Callable[[], None], logger: logging.Logger, url: str = ""
) -> tenacity.AsyncRetrying:
    """``async for attempt in retry_forever(...): with attempt: ...`` retries any
    exception after 0-0.5 s of backoff; each failure calls ``on_failure`` (a counter) and
    logs a warning naming ``what`` failed, with the credentials of ``url`` blanked out.

    The backoff is capped low so that a backend back from a restart is used again
    within half a second: a publisher's queue fills while it waits.

    A cancel of the calling task that the backend's client swallowed (the failure being
    retried may be what it turned the cancel into) is raised before each attempt and
    each backoff: a cancelled retry never goes on (`kvbus.shutdown`)."""

    def before_sleep(state: tenacity.RetryCallState) -> None:
        raise_if_cancelling()
        on_failure()
        log_failure(logger, what, state.outcome.exception() if state.outcome else None, url)

    return tenacity.AsyncRetrying(
        wait=tenacity.wait_random_exponential(multiplier=0.02, max=0.5),
        retry=tenacity.retry_if_exception_type(Exception)
        & tenacity.retry_if_not_exception_type(BackendUnusable),
        before=lambda _state: raise_if_cancelling(),
        before_sleep=before_sleep,
    )


_limited_logs: dict[str, LimitedLog] = {}
"""One rate limit per logger: a backend that is down fails every retry (about 20 a
second against a refusing Redis), and the log should say so once a second, not 20 times."""


def log_failure(logger: logging.Logger, what: str, error: BaseException | None, url: str) -> None:
    """The warning `retry_forever` logs for a failed attempt: at most one a second for
    each ``what``, saying how many more failed in between."""
    limited = _limited_logs.get(logger.name)
    if limited is None:
        limited = _limited_logs.setdefault(logger.name, LimitedLog(logger))
    shown_error = redact_text(repr(error), [url])
    limited.warning(what, "kvbus: %s failed (%s); retrying", what, shown_error)
