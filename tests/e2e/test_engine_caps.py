"""Issue 39's engine caps through real gunicorn, each refused before any swarm work (milliseconds on the shared
gateway): n choices no client may hold, and a logit_bias past OpenAI's 300 entries, are 400s naming their field."""

import requests

from shared_gateways import TINY_MAX_SESSIONS

MESSAGES = [{"role": "user", "content": "Hello"}]


def test_more_choices_than_sessions_a_client_may_hold_is_a_400_naming_n(gateway):
    reply = requests.post(gateway.url + "/v1/chat/completions", timeout=30,
                          json={"messages": MESSAGES, "n": TINY_MAX_SESSIONS + 1, "max_tokens": 2})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "n", error
    assert f"at most {TINY_MAX_SESSIONS} choices" in error["message"]


def test_a_logit_bias_past_300_entries_is_a_400_naming_it(gateway):
    bias = {str(token): 1 for token in range(301)}
    reply = requests.post(gateway.url + "/v1/completions", timeout=30,
                          json={"prompt": "Hi", "max_tokens": 2, "logit_bias": bias})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "logit_bias", error
