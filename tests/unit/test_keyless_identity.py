"""Who a caller is without API keys (issue 32, item 9): an address is everyone behind one NAT or proxy, so unless
KEYLESS_SHARING says they are one user, nothing kept for a caller between requests is shared among them: MLC's
stateful conversations and saved states are refused naming the setting, and a request reuses no warm prefix that
another request left (only its own cache_salt buys reuse). Reuse goes by whole cache pages, and /stats shows a
caller its own requests only. Through the app's test client over the tiny model run in process."""

import pytest

from config import AccessSettings, GatewaySettings, ModelConfig, Settings, SwarmSettings
from gateway import create_app
from gateway.engine.generation import Engine
from swarm.protocol import PAGE_TOKENS
from local_remote import LocalRemote

SYSTEM = {"role": "system", "content": "You are the assistant of Ada; her password is swordfish, never tell it."}


@pytest.fixture(scope="module")
def remote(tiny_llama):
    return LocalRemote(tiny_llama)


def app_with(access: AccessSettings, tiny_llama, remote, tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=512),), access=access)
    settings = Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway)
    return create_app(settings, Engine(settings, connect=lambda config: remote)).test_client()


def chat(client, messages, key=None, **fields):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    reply = client.post("/v1/chat/completions", headers=headers,
                        json={"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.get_json()
    return reply.get_json()["usage"]


def cached(usage) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_without_keys_stateful_chat_and_saved_states_are_refused_naming_the_setting(tiny_llama, remote, tmp_path):
    client = app_with(AccessSettings(), tiny_llama, remote, tmp_path)
    messages = [{"role": "user", "content": "Hi"}]
    refused = [client.post("/chat/completions", json={"model": "tiny", "messages": messages}),
               client.get("/chat/reset"),
               client.post("/v1/states", json={"name": "s", "messages": messages}),
               client.get("/v1/states"), client.get("/api/oai/v1/states"),
               client.delete("/v1/states/s"),
               client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "state": "s"})]
    for reply in refused:
        error = reply.get_json()["error"]
        assert reply.status_code == 403 and error["code"] == "keyless_sharing_off", reply.get_json()
        assert "KEYLESS_SHARING" in error["message"] and "API_KEYS" in error["message"]
    assert refused[-1].get_json()["error"]["param"] == "state"


@pytest.mark.parametrize("access", [AccessSettings(keyless_sharing=True), AccessSettings(api_keys=("k1",))])
def test_with_keys_or_keyless_sharing_the_stateful_routes_answer(access, tiny_llama, remote, tmp_path):
    client = app_with(access, tiny_llama, remote, tmp_path)
    headers = {"Authorization": "Bearer k1"}
    assert client.get("/v1/states", headers=headers).get_json() == {"object": "list", "data": []}
    assert client.get("/chat/reset", headers=headers).status_code == 200


def test_without_keys_a_request_never_reuses_a_prefix_another_request_left(tiny_llama, remote, tmp_path):
    """Two people behind one address: the second one's prompt starts with the first one's system prompt, and learns
    nothing of it from cached_tokens (nor from timing: it is computed whole)."""
    client = app_with(AccessSettings(), tiny_llama, remote, tmp_path)
    chat(client, [SYSTEM, {"role": "user", "content": "What is my password?"}])
    guess = [SYSTEM, {"role": "user", "content": "Hello, who are you?"}]
    assert cached(chat(client, guess)) == 0
    assert cached(chat(client, guess)) == 0  # nor its own earlier request: nothing was kept
    # a cache_salt is a secret the client holds: its own requests giving it continue each other
    chat(client, guess, cache_salt="a secret of mine")
    assert cached(chat(client, guess, cache_salt="a secret of mine")) > 0
    assert cached(chat(client, guess, cache_salt="another")) == 0


def test_with_keyless_sharing_requests_reuse_each_others_prefixes_by_whole_pages(tiny_llama, remote, tmp_path):
    client = app_with(AccessSettings(keyless_sharing=True), tiny_llama, remote, tmp_path)
    first = chat(client, [SYSTEM, {"role": "user", "content": "What is my password?"}])
    assert cached(first) == 0
    usage = chat(client, [SYSTEM, {"role": "user", "content": "Hello, who are you?"}])
    # the shared prefix is the system prompt and a little more, never a whole number of pages by itself
    assert cached(usage) > 0 and cached(usage) % PAGE_TOKENS == 0


def test_stats_show_a_caller_its_own_requests_only(tiny_llama, remote, tmp_path):
    client = app_with(AccessSettings(api_keys=("k1", "k2")), tiny_llama, remote, tmp_path)
    chat(client, [{"role": "user", "content": "Hi"}], key="k1")
    mine = client.get("/verbose_stats", headers={"Authorization": "Bearer k1"}).get_json()
    assert mine["requests"] == 1 and mine["prompt_tokens"] > 0
    theirs = client.get("/verbose_stats", headers={"Authorization": "Bearer k2"}).get_json()
    assert theirs["requests"] == 0 and theirs["prompt_tokens"] == 0
    assert client.get("/stats", headers={"Authorization": "Bearer k2"}).get_json() == {
        "prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0}
    assert client.get("/stats", headers={"Authorization": "Bearer k1"}).get_json()["decode_tokens_per_s"] > 0


def test_keyless_sharing_is_off_in_settings_unless_the_environment_turns_it_on():
    assert not AccessSettings.from_env({}).keyless_sharing and not AccessSettings.from_env({}).keeps_caller_state
    assert AccessSettings.from_env({"KEYLESS_SHARING": "1"}).keeps_caller_state
    assert AccessSettings.from_env({"API_KEYS": "k1"}).keeps_caller_state



def test_python_app_py_keyless_sharing_flag_hands_the_setting_to_gunicorn():
    """`python app.py --keyless-sharing` (a laptop's own gateway) sets KEYLESS_SHARING for gunicorn's worker (in a
    process of its own: app.py configures the process's logging)."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import runpy, sys, gunicorn.app.wsgiapp as wsgiapp; wsgiapp.run = lambda: print(sys.argv); "
              "sys.argv = ['app.py', *sys.argv[1:]]; runpy.run_path('app.py', run_name='__main__')")
    root = Path(__file__).resolve().parents[2]

    def gunicorn_argv(*flags: str) -> str:
        return subprocess.run([sys.executable, "-c", script, *flags], cwd=root, capture_output=True, text=True,
                              check=True, timeout=120).stdout

    assert "KEYLESS_SHARING=1" in gunicorn_argv("--keyless-sharing")
    assert "KEYLESS_SHARING" not in gunicorn_argv()


def gunicorn_conf():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "gunicorn.conf.py"
    spec = importlib.util.spec_from_file_location("gunicorn_conf_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bind, local", [
    ("127.0.0.1:5000", True), ("127.0.0.1", True), ("[::1]:5000", True), ("::1", True), ("localhost:5000", True),
    ("unix:/run/gateway.sock", True), ("0.0.0.0:5000", False), ("192.168.1.20:5000", False), ("[::]:5000", False),
    ("example.org:5000", False), ("fd://3", False),
])
def test_a_bind_is_local_only_on_loopback_or_a_unix_socket(bind, local):
    assert gunicorn_conf()._loopback_only(bind) is local


class _Log:
    def __init__(self):
        self.lines = []

    def warning(self, message, *args):
        self.lines.append(message % args)


@pytest.mark.parametrize("binds, keys, said, shared, warned, proxies", [
    (["127.0.0.1:5000"], "", None, True, False, 0),  # `make run`: the machine's owner alone
    (["127.0.0.1:5000"], "", None, False, True, 1),  # behind nginx on this machine: its callers are anyone's
    (["127.0.0.1:5000", "[::1]:5000"], "", None, True, False, 0),
    (["0.0.0.0:5000"], "", None, False, True, 0),  # a public address without keys: strangers, and a line says so
    (["127.0.0.1:5000", "0.0.0.0:5001"], "", None, False, True, 0),  # one bind beyond loopback is enough
    (["0.0.0.0:5000"], "k1", None, False, False, 0),  # keys tell clients apart: nothing to warn about
    (["127.0.0.1:5000"], "", "0", False, False, 0),  # an explicit setting wins either way
    (["0.0.0.0:5000"], "", "1", True, False, 0),
])
def test_keyless_sharing_follows_where_the_gateway_listens_unless_set(binds, keys, said, shared, warned, proxies):
    from types import SimpleNamespace

    # an environment of its own: the decision writes to it, and one leaked into this worker's os.environ would
    # decide for every gateway a later test starts
    environ = {} if said is None else {"KEYLESS_SHARING": said}
    server = SimpleNamespace(cfg=SimpleNamespace(bind=binds), log=_Log())
    access = AccessSettings(api_keys=(keys,) if keys else (), trusted_proxies=proxies)
    gunicorn_conf()._share_where_only_this_machine_reaches(server, access, environ)
    assert AccessSettings.from_env(environ).keyless_sharing is shared
    assert bool(server.log.lines) is warned
    if warned:
        assert "API_KEYS" in server.log.lines[0] and "KEYLESS_SHARING=1" in server.log.lines[0]


@pytest.mark.parametrize("name", ["KEYLESS_SHARING", "ALLOW_CREDENTIALS"])
def test_a_yes_or_no_setting_that_is_neither_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=name):
        AccessSettings.from_env({name: "ture"})
    assert AccessSettings.from_env({name: "yes"}) == AccessSettings.from_env({name: "1"})
