"""The teardown check of every test gateway (running_gateway): it must catch what the old one (`"Traceback" not
in log or "expected" in log`) let through, and pass a clean log; an error a test causes on purpose passes only
where it is named, and only if it appears."""

import pytest

from gateway_log import assert_clean_log, serious_lines, unexpected_lines

CLEAN = """[2026-11-23 11:22:23 +0000] [20414] [INFO] Starting gunicorn 27.0.1
2026-11-23 11:22:41,958 INFO gateway.engine.sessions [-] closed inference session 6dbe after 4 s idle
2026-11-23 11:22:42,001 WARNING gateway.engine.generation [abc] a reply mentions an unexpected Traceback, not at a line start
"""


def test_a_clean_log_passes():
    assert serious_lines(CLEAN) == []
    assert_clean_log(CLEAN)


@pytest.mark.parametrize("bad, first", [
    ("2026-11-23 11:26:51,571 ERROR gateway.errors [022e] unexpected error\nTraceback (most recent call last):\n"
     "  File \"gateway/engine.py\", line 1\nRuntimeError: boom\n", "ERROR gateway.errors"),
    ("2026-11-23 11:26:51,571 WARNING gateway.engine.generation [-] closing session 1 failed\n"
     "Traceback (most recent call last):\n  File \"x.py\", line 1\nOSError: gone\n", "Traceback (most recent"),
    ("2026-11-23 11:26:51,571 ERROR gateway.errors [1] a block server refused a request: no\n", "a block server"),
    ("[2026-11-23 11:26:33 +0000] [23432] [CRITICAL] WORKER TIMEOUT (pid:23433)\n", "WORKER TIMEOUT"),
    ("[2026-11-23 11:26:33 +0000] [23433] [ERROR] Error handling request /v1/chat/completions\n", "Error handling"),
])
def test_an_error_or_a_traceback_fails_even_when_expected_appears(bad, first):
    log = CLEAN + bad + "2026-11-23 11:27:00,000 INFO gateway.x [-] as expected\n"
    assert first in serious_lines(log)[0]
    with pytest.raises(AssertionError, match="the gateway logged"):
        assert_clean_log(log)


ON_PURPOSE = ("2026-11-23 11:26:51,571 ERROR gateway.errors [022e] unexpected error\nTraceback (most recent call last):\n"
              "  File \"gateway/engine.py\", line 1\nRuntimeError: boom on purpose\n")


def test_an_expected_error_and_its_own_traceback_pass_when_named():
    assert unexpected_lines(CLEAN + ON_PURPOSE, ["gateway.errors .* unexpected error$"]) == []
    assert_clean_log(CLEAN + ON_PURPOSE, ["gateway.errors .* unexpected error$"])


@pytest.mark.parametrize("log, expected, message", [
    (CLEAN, ["unexpected error"], "never logged the expected"),  # named, but it did not happen
    (CLEAN + ON_PURPOSE + "[2026-11-23 11:26:33 +0000] [23432] [CRITICAL] WORKER TIMEOUT (pid:23433)\n",
     ["unexpected error"], "the gateway logged 1 error"),  # another error besides
    (CLEAN + ON_PURPOSE + "2026-11-23 11:27:00,000 WARNING gateway.x [-] retrying\nTraceback (most recent call last):\n",
     ["unexpected error"], "the gateway logged 1 error"),  # a traceback of a line not named
    (CLEAN + ON_PURPOSE, ["Traceback"], "the gateway logged 2 error"),  # a traceback is never named by itself
])
def test_an_error_not_named_or_a_named_one_missing_fails(log, expected, message):
    with pytest.raises(AssertionError, match=message):
        assert_clean_log(log, expected)
