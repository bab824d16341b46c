"""API keys, CORS, the WebSocket Origin check and who a caller is, through the Flask test client (no swarm needed:
every request here stops before one)."""

import pytest

from config import AccessSettings, GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway import create_app


def app_with(access: AccessSettings, tmp_path, limits: Limits = Limits()):
    gateway = GatewaySettings(models=(ModelConfig("m", "m"),), access=access, limits=limits)
    return create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway)).test_client()


def test_cors_follows_the_allowlist(tmp_path):
    client = app_with(AccessSettings(allowed_origins=("https://chat.example",), allow_credentials=True), tmp_path)
    preflight = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST"}
    allowed = client.options("/v1/chat/completions", headers=preflight)
    assert allowed.headers["Access-Control-Allow-Origin"] == "https://chat.example"
    assert allowed.headers["Access-Control-Allow-Credentials"] == "true"
    refused = client.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in refused.headers


def test_keys_guard_every_api_but_health_pages_and_docs(tmp_path):
    client = app_with(AccessSettings(api_keys=("k1",)), tmp_path)
    openai_style = client.post("/v1/chat/completions", json={})
    assert openai_style.status_code == 401 and openai_style.json["error"]["type"] == "authentication_error"
    petals_style = client.post("/api/v1/generate", json={}, headers={"Authorization": "Bearer nope"})
    assert petals_style.status_code == 401 and petals_style.json["ok"] is False
    assert client.get("/api/v2/generate?api_key=wrong").status_code == 401
    assert client.get("/metrics").status_code == 401
    for path in ("/openapi.json", "/docs", "/", "/swarm"):
        assert client.get(path).status_code == 200, path
    # with the key, the request gets past the check (and fails later, on its empty body)
    assert client.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer k1"}).status_code == 400
    assert client.post("/v1/chat/completions", json={}, headers={"X-API-Key": "k1"}).status_code == 400


HANDSHAKE = {"Upgrade": "websocket", "Connection": "Upgrade"}


@pytest.mark.parametrize("origin, allowed", [
    ("https://evil.example", False),
    ("https://chat.example", True),  # on the allowlist
    ("http://localhost", True),  # the gateway's own page (the test client's host)
    (None, True),  # not a browser: the key decides
])
def test_websocket_handshakes_follow_the_origin_allowlist(tmp_path, origin, allowed):
    client = app_with(AccessSettings(api_keys=("k1",), allowed_origins=("https://chat.example",)), tmp_path)
    headers = {**HANDSHAKE, **({"Origin": origin} if origin else {})}
    reply = client.get("/api/v2/generate", headers=headers)
    if allowed:  # past the origin check, stopped by the missing key
        assert reply.status_code == 401
    else:
        assert reply.status_code == 403 and reply.json["code"] == "origin_not_allowed"
        assert "ALLOWED_ORIGINS" in reply.json["error"]


def test_any_origin_by_default(tmp_path):
    client = app_with(AccessSettings(api_keys=("k1",)), tmp_path)
    assert client.get("/api/v2/generate", headers={**HANDSHAKE, "Origin": "https://anywhere.example"}).status_code == 401


def spend_one(client, **kwargs) -> int:
    return client.post("/v1/chat/completions", json={}, **kwargs).status_code


def test_a_key_is_a_client_of_its_own(tmp_path):
    client = app_with(AccessSettings(api_keys=("k1", "k2")), tmp_path, Limits(requests_per_minute=1))
    assert spend_one(client, headers={"X-API-Key": "k1"}) == 400
    assert spend_one(client, headers={"X-API-Key": "k1"}) == 429
    assert spend_one(client, headers={"X-API-Key": "k2"}) == 400  # same address, another key: its own allowance


def test_without_keys_the_address_is_the_client_and_a_made_up_key_changes_nothing(tmp_path):
    client = app_with(AccessSettings(), tmp_path, Limits(requests_per_minute=1))
    assert spend_one(client, headers={"Authorization": "Bearer a"}) == 400
    assert spend_one(client, headers={"Authorization": "Bearer b"}) == 429
    assert spend_one(client, environ_base={"REMOTE_ADDR": "10.0.0.2"}) == 400


@pytest.mark.parametrize("trusted_proxies, separate", [(0, False), (1, True)])
def test_forwarded_addresses_count_only_behind_trusted_proxies(tmp_path, trusted_proxies, separate):
    client = app_with(AccessSettings(trusted_proxies=trusted_proxies), tmp_path, Limits(requests_per_minute=1))
    assert spend_one(client, headers={"X-Forwarded-For": "198.51.100.1"}) == 400
    second = spend_one(client, headers={"X-Forwarded-For": "198.51.100.2"})
    assert second == (400 if separate else 429)
