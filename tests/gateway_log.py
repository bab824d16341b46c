"""What a gateway's log (a conftest `Gateway`'s gunicorn output) must never hold after the tests that used it.

The gateway logs at ERROR only for its own faults: an unexpected exception ("unexpected error" and its traceback,
gateway/errors.py), a block server refusing what the gateway sent, a failing session reaper; gunicorn logs at
ERROR when a worker times out or a request cannot be handled. None of these is a client's doing, so none may
appear; nor may a traceback at any level (a WARNING with exc_info has one too). No test that shares a gateway
causes one on purpose: a test that must, starts a gateway of its own and checks that log for its exact line.
"""

from __future__ import annotations

import re

# ours: "2026-01-01 12:00:00,000 ERROR gateway.errors [request-id] ..." (gateway/request_ids.py LOG_FORMAT);
# gunicorn's: "[2026-01-01 12:00:00 +0000] [1234] [ERROR] ..."
SERIOUS_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \S+ (ERROR|CRITICAL) |\[[^\]]+\] \[\d+\] \[(ERROR|CRITICAL)\] )"
                          r"|^Traceback \(most recent call last\)")


def serious_lines(log: str) -> list[str]:
    """Each line of the log at ERROR or above, and the first line of each traceback."""
    return [line for line in log.splitlines() if SERIOUS_LINE.match(line)]


def assert_clean_log(log: str) -> None:
    found = serious_lines(log)
    start = log.find(found[0]) if found else 0
    assert not found, f"the gateway logged {len(found)} error(s) or traceback(s); the first:\n{log[start:start + 4000]}"
