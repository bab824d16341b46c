"""The gateway's limits as units: the rate limiter's buckets, the session caps, the body size, the token and
context-length checks, and reading Limits from the environment."""

import pytest

from config import AccessSettings, GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway import create_app
from gateway.web import limits
from gateway.errors import BadRequest, LengthExceeded, NotFound, RateLimited, TooManySessions
from gateway.engine.lengths import check_context_length, check_new_tokens
from gateway.web.limits import RateLimiter
from gateway.engine.sessions import SessionRegistry


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    return now


def test_a_burst_of_a_minutes_allowance_then_429_with_retry_after(clock):
    limiter = RateLimiter(per_minute=6)  # one every 10 s
    for _ in range(6):
        limiter.charge("a")
    with pytest.raises(RateLimited) as refused:
        limiter.charge("a")
    assert refused.value.status == 429 and refused.value.headers() == {"Retry-After": "10"}
    assert "REQUESTS_PER_MINUTE" in refused.value.message
    limiter.charge("b")  # another client has its own bucket
    clock[0] += 10
    limiter.charge("a")  # refilled by one
    with pytest.raises(RateLimited):
        limiter.charge("a")


def test_no_limit_when_zero(clock):
    limiter = RateLimiter(per_minute=0)
    for _ in range(1000):
        limiter.charge("a")


def test_idle_clients_are_forgotten_busy_ones_kept(clock, monkeypatch):
    monkeypatch.setattr(RateLimiter, "PRUNE_ABOVE", 3)
    limiter = RateLimiter(per_minute=60)
    for client in "abcd":  # four busy clients: nothing to forget yet, so the next look waits for twice as many
        limiter.charge(client)
    assert len(limiter._buckets) == 4
    clock[0] += 60  # a, b, c and d are idle now: their buckets are full again
    for client in "efghi":
        limiter.charge(client)
    assert set(limiter._buckets) == set("efghi")


class FakeSession:
    def __init__(self, number, owner):
        self.id, self.owner, self.expires = f"s{number}", owner, False


def test_sessions_are_capped_per_client_and_overall():
    registry = SessionRegistry(max_sessions=3, idle_timeout=60, max_per_client=2)
    for number, owner in enumerate(["a", "a"]):
        with registry.reserve(owner):
            registry.add(FakeSession(number, owner))
    with pytest.raises(TooManySessions, match="MAX_SESSIONS_PER_CLIENT"):
        with registry.reserve("a"):
            pass
    with registry.reserve("b"):
        registry.add(FakeSession(2, "b"))
    with pytest.raises(TooManySessions, match="MAX_SESSIONS\\)"):
        with registry.reserve("c"):
            pass
    registry.remove(registry.get("s0"))
    with registry.reserve("a"):  # a slot of its own again
        pass


def test_a_session_still_opening_holds_its_slot():
    registry = SessionRegistry(max_sessions=5, idle_timeout=60, max_per_client=1)
    with registry.reserve("a"):
        with pytest.raises(TooManySessions):
            with registry.reserve("a"):
                pass
    with registry.reserve("a"):  # released, also when opening failed
        pass


class LockedSession(FakeSession):
    def __init__(self, number, owner):
        import threading

        super().__init__(number, owner)
        self.lock, self.last_used = threading.Lock(), 0.0

    def settle(self):  # no reply runs on it
        pass


def test_with_keys_a_session_by_id_is_its_openers_alone():
    """Another key gets the 404 of an unknown id; an address proves nothing, so the id alone grants access then."""
    registry = SessionRegistry(max_sessions=5, idle_timeout=60)
    registry.add(LockedSession(1, "key:alice"))
    registry.add(LockedSession(2, "ip:10.0.0.1"))
    with registry.use("s1", "key:alice") as session:
        assert session.id == "s1"
    with pytest.raises(NotFound, match="unknown inference session 's1'"):
        with registry.use("s1", "key:mallory"):
            pass
    with registry.use("s2", "ip:10.0.0.2") as session:
        assert session.id == "s2"


def test_inputs_and_their_tokens_are_capped_per_request():
    caps = Limits(max_inputs_per_request=4, max_input_tokens_per_request=100)
    limits.check_input_count(caps, "input", 4)
    limits.check_input_tokens(caps, "input", 100)
    with pytest.raises(BadRequest, match=r"^input: at most 4 inputs in one request, got 5 \(MAX_INPUTS_PER_REQUEST\)$"):
        limits.check_input_count(caps, "input", 5)
    with pytest.raises(BadRequest, match=r"choices: at most 100 tokens .* got 101 \(MAX_INPUT_TOKENS_PER_REQUEST\)"):
        limits.check_input_tokens(caps, "choices", 101)
    assert Limits().max_inputs_per_request == 2048  # OpenAI's


def test_token_and_context_checks_name_the_field():
    with pytest.raises(BadRequest, match="max_tokens: at most 16, got 17 \\(MAX_NEW_TOKENS\\)") as caught:
        check_new_tokens("max_tokens", 17, 16)
    assert caught.value.field == "max_tokens"
    check_new_tokens("max_tokens", 16, 16)
    model = ModelConfig("m", "m", max_session_length=64)
    check_context_length(model, 60, 4, "messages")
    with pytest.raises(LengthExceeded) as caught:
        check_context_length(model, 60, 5, "messages")
    assert caught.value.code == "context_length_exceeded" and caught.value.field == "messages"
    assert "maximum context length is 64 tokens" in caught.value.message and "65 tokens" in caught.value.message


def test_limits_from_the_environment():
    assert Limits.from_env({"REQUESTS_PER_MINUTE": "5", "WS_IDLE_TIMEOUT": "2.5"}) == \
        Limits(requests_per_minute=5, ws_idle_timeout=2.5)
    with pytest.raises(ValueError, match="MAX_BODY_BYTES: expected int, got 'lots'"):
        Limits.from_env({"MAX_BODY_BYTES": "lots"})


@pytest.mark.parametrize("environ, field", [
    ({"PIPELINE_GROUPS": "-1"}, "PIPELINE_GROUPS"), ({"PIPELINE_MIN_SESSIONS": "0"}, "PIPELINE_MIN_SESSIONS"),
    ({"PIPELINE_GROUPS": "two"}, "PIPELINE_GROUPS"),
    ({"ENGINE_MAX_STEPS": "-1"}, "ENGINE_MAX_STEPS"), ({"ENGINE_SHARING": "key"}, "ENGINE_SHARING"),
    ({"ENGINE_MAX_STEPS": "many"}, "ENGINE_MAX_STEPS"),
    ({"HTTP_HEADER_TIMEOUT": "0"}, "HTTP_HEADER_TIMEOUT"), ({"HTTP_HEADER_TIMEOUT": "nan"}, "HTTP_HEADER_TIMEOUT"),
    ({"HALF_OPEN_PER_ADDRESS": "0"}, "HALF_OPEN_PER_ADDRESS"),
])
def test_a_bad_engine_or_connection_setting_is_refused_naming_it(environ, field):
    with pytest.raises(ValueError, match=field):
        Limits.from_env(environ)


def test_a_body_over_the_limit_is_413_in_each_apis_shape(tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("m", "m"),), limits=Limits(max_body_bytes=100),
                              access=AccessSettings())
    client = create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway)).test_client()
    petals = client.post("/api/v1/generate", data="x" * 101)
    assert petals.status_code == 413 and petals.json["code"] == "request_too_large"
    assert "limit of 100 bytes (MAX_BODY_BYTES)" in petals.json["error"]
    openai = client.post("/v1/chat/completions", data="x" * 101, content_type="application/json")
    assert openai.status_code == 413 and openai.json["error"]["code"] == "request_too_large"
    form = client.post("/api/v1/generate", data={"inputs": "x" * 200})  # a form field over it, too
    assert form.status_code == 413
