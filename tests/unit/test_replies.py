"""What every reply carries and never carries, through the Flask test client: the request id, errors in the shape
of their API (Flask's own 404 and 405 included), and JSON that is refused cleanly however it is broken."""

import json
import logging

import pytest

from config import GatewaySettings, ModelConfig, Settings, SwarmSettings
from gateway import create_app
from gateway.web import request_ids
from gateway.errors import BadRequest
from gateway.web.bodies import load_json


@pytest.fixture
def app(tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("m", "m"),))
    return create_app(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway))


def test_request_ids_are_returned_taken_or_replaced(app):
    client = app.test_client()
    made_up = client.post("/v1/chat/completions", json={}).headers["X-Request-ID"]
    assert len(made_up) == 32 and client.get("/health-nope").headers["X-Request-ID"] != made_up
    assert client.post("/api/v1/generate", json={}, headers={"X-Request-ID": "edge-7.a:1"}).headers[
        "X-Request-ID"] == "edge-7.a:1"
    forged = "x] ERROR gateway: a fake line [" + "y" * 100
    replaced = client.post("/api/v1/generate", json={}, headers={"X-Request-ID": forged}).headers["X-Request-ID"]
    assert replaced != forged and len(replaced) == 32


def test_log_records_carry_the_request_id(app):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    handler.addFilter(request_ids.RequestIdFilter())
    logger = logging.getLogger("gateway.test")
    logger.addHandler(handler)
    try:
        with app.test_request_context("/api/v1/generate", headers={"X-Request-ID": "req-42"}):
            app.preprocess_request()
            logger.warning("inside")
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
    assert [record.request_id for record in records] == ["req-42", "-"]


@pytest.mark.parametrize("method, path, status, shape", [
    ("get", "/v1/chat/completions", 405, "openai"),
    ("get", "/api/oai/v1/nowhere", 404, "openai"),
    ("post", "/api/v1/models", 405, "petals"),
    ("get", "/api/v1/nowhere", 404, "petals"),
])
def test_flasks_own_refusals_take_the_shape_of_their_api(app, method, path, status, shape):
    reply = getattr(app.test_client(), method)(path)
    assert reply.status_code == status and reply.is_json
    if shape == "openai":
        assert set(reply.json["error"]) == {"message", "type", "param", "code"}
        assert reply.json["error"]["type"] == "invalid_request_error"
    else:
        assert reply.json["ok"] is False and reply.json["traceback"] == reply.json["error"]
    if status == 405:
        assert "Allow" in reply.headers


@pytest.mark.parametrize("raw, reason", [
    ("[" * 100_000, "nested too deeply"),
    ('{"temperature": NaN}', "NaN is not a JSON value"),
    ('{"top_p": -Infinity}', "-Infinity is not a JSON value"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    ("1" * 5000, "not valid JSON"),  # past Python's digits limit for int()
    ("", "not valid JSON"),
])
def test_broken_json_is_a_bad_request(raw, reason):
    with pytest.raises(BadRequest, match=reason):
        load_json(raw)


def test_json_deeper_than_any_request_is_a_bad_request_naming_its_field():
    """Parsed JSON 101 levels deep (Python's parser takes some 1,000) would reach code that walks it recursively."""
    deep = "[" * 99 + "]" * 99
    assert load_json('{"ok": %s}' % deep) == {"ok": json.loads(deep)}  # 100 levels: fine
    with pytest.raises(BadRequest, match=r"^tools: nested deeper than 100 levels$") as refused:
        load_json('{"model": "x", "tools": [%s]}' % deep)  # 101 levels
    assert refused.value.field == "tools"
    with pytest.raises(BadRequest, match=r"^the message is nested deeper than 100 levels$"):
        load_json("[[%s]]" % deep, "the message")


def test_deep_json_over_http_is_400_not_500(app):
    reply = app.test_client().post("/v1/completions", data="[" * 100_000, content_type="application/json")
    assert reply.status_code == 400 and "nested too deeply" in reply.json["error"]["message"]
