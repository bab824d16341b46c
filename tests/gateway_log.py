"""What a gateway's log (the gunicorn output of tests/gunicorn_gateway.py's `running_gateway`) must never hold
after the tests that used it.

The gateway logs at ERROR only for its own faults: an unexpected exception ("unexpected error" and its traceback,
gateway/errors.py), a block server refusing what the gateway sent, a failing session reaper; gunicorn logs at
ERROR when a worker times out or a request cannot be handled. None of these is a client's doing, so none may
appear; nor may a traceback at any level (a WARNING with exc_info has one too). No test that shares a gateway
causes one on purpose: a test that must, starts a gateway of its own and checks that log for its exact line
(running_gateway's `expected_errors`: each must appear, and nothing else serious may).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# ours: "2026-01-01 12:00:00,000 ERROR gateway.errors [request-id] ..." (gateway/request_ids.py LOG_FORMAT);
# gunicorn's: "[2026-01-01 12:00:00 +0000] [1234] [ERROR] ..."
SERIOUS_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \S+ (ERROR|CRITICAL) |\[[^\]]+\] \[\d+\] \[(ERROR|CRITICAL)\] )"
                          r"|^Traceback \(most recent call last\)")


def serious_lines(log: str) -> list[str]:
    """Each line of the log at ERROR or above, and the first line of each traceback."""
    return [line for line in log.splitlines() if SERIOUS_LINE.match(line)]


def unexpected_lines(log: str, expected_errors: Sequence[str] = ()) -> list[str]:
    """The serious lines of the log but the ERROR or CRITICAL lines a pattern of `expected_errors` finds
    (re.search), each with the traceback right after it, if any (its own)."""
    found, after_expected = [], False
    for line in log.splitlines():
        if not SERIOUS_LINE.match(line) or (after_expected and line.startswith("Traceback")):
            after_expected = False
        elif line.startswith("Traceback") or not any(re.search(pattern, line) for pattern in expected_errors):
            found.append(line)
            after_expected = False
        else:
            after_expected = True
    return found


def assert_clean_log(log: str, expected_errors: Sequence[str] = ()) -> None:
    """No error and no traceback in the log, but for the lines `expected_errors` (regular expressions) find and
    their own tracebacks; each of those patterns must find an ERROR or CRITICAL line."""
    found = unexpected_lines(log, expected_errors)
    start = log.find(found[0]) if found else 0
    assert not found, f"the gateway logged {len(found)} error(s) or traceback(s); the first:\n{log[start:start + 4000]}"
    errors = [line for line in serious_lines(log) if not line.startswith("Traceback")]
    missing = [pattern for pattern in expected_errors if not any(re.search(pattern, line) for line in errors)]
    assert not missing, f"the gateway never logged the expected error(s) {missing}"
