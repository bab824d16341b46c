"""API keys and CORS, through the Flask test client (no swarm needed: every request here stops before one)."""

from config import AccessSettings, GatewaySettings, ModelConfig, Settings, SwarmSettings
from gateway import create_app


def app_with(access: AccessSettings, tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("m", "m"),), access=access)
    return create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway)).test_client()


def test_cors_follows_the_allowlist(tmp_path):
    client = app_with(AccessSettings(allowed_origins=("https://chat.example",), allow_credentials=True), tmp_path)
    preflight = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST"}
    allowed = client.options("/v1/chat/completions", headers=preflight)
    assert allowed.headers["Access-Control-Allow-Origin"] == "https://chat.example"
    assert allowed.headers["Access-Control-Allow-Credentials"] == "true"
    refused = client.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in refused.headers


def test_keys_guard_every_api_but_health_and_docs(tmp_path):
    client = app_with(AccessSettings(api_keys=("k1",)), tmp_path)
    openai_style = client.post("/v1/chat/completions", json={})
    assert openai_style.status_code == 401 and openai_style.json["error"]["type"] == "authentication_error"
    petals_style = client.post("/api/v1/generate", json={}, headers={"Authorization": "Bearer nope"})
    assert petals_style.status_code == 401 and petals_style.json["ok"] is False
    assert client.get("/api/v2/generate?api_key=wrong").status_code == 401
    assert client.get("/openapi.json").status_code == 200 and client.get("/docs").status_code == 200
    # with the key, the request gets past the check (and fails later, on its empty body)
    assert client.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer k1"}).status_code == 400
