"""The web chat page (static/) in a real headless Chromium, driven by Playwright, against real gunicorn in front
of a real local swarm of the tiny model. Where a check needs the gateway to misbehave on cue (a hostile reply,
a dropped connection, a session to outgrow), Playwright plays the gateway's side of the WebSocket instead.

Screenshots go to $TEST_ARTIFACTS (or a temporary folder). The swarm-down test stops the module's swarm, so it
comes last.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gunicorn_gateway import running_gateway

sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"  # Debian's package; `playwright install` is never needed
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PREFIX = "tinychat"
MODEL = "tiny"
IDLE = "() => document.querySelector('#stop').hidden"  # no reply is being generated
EVIL = "<img src=x onerror=alert(1)>"


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def chat_swarm(tiny_llama, tmp_path_factory):
    from swarm.local import LocalSwarm

    swarm = LocalSwarm(str(tiny_llama), [(0, 2), (2, 4)], server_args=["--dht-prefix", PREFIX],
                       log_dir=tmp_path_factory.mktemp("chat-swarm-logs"))
    with swarm:
        yield swarm


@pytest.fixture(scope="module")
def chat_gateway(chat_swarm, tiny_llama, tmp_path_factory):
    models = [{"name": MODEL, "path": str(tiny_llama), "dht_prefix": PREFIX, "max_session_length": 1024}]
    env = {"INITIAL_PEERS": " ".join(chat_swarm.initial_peers), "MODELS": json.dumps(models), "MAX_SESSIONS": "8",
           "BLOCK_WAIT_SECONDS": "1"}  # the swarm-down test's request fails after a second, not the default 30
    with running_gateway(env, tmp_path_factory.mktemp("chat-gateway")) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    if not os.environ.get("TEST_ARTIFACTS"):
        return tmp_path_factory.mktemp("chat-page")
    folder = Path(os.environ["TEST_ARTIFACTS"])
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Frames:
    """The JSON messages the page sends and receives on /api/v2/generate, as Playwright observes them."""

    def __init__(self, page):
        self.sent: list[dict] = []
        self.received: list[dict] = []
        self.urls: list[str] = []
        page.on("websocket", self._attach)

    def _attach(self, ws) -> None:
        if "/api/v2/generate" in ws.url:  # with ?api_key= when the gateway has keys
            self.urls.append(ws.url)
            ws.on("framesent", lambda payload: self.sent.append(json.loads(payload)))
            ws.on("framereceived", lambda payload: self.received.append(json.loads(payload)))

    def sent_of(self, kind: str, since: int = 0) -> list[dict]:
        return [frame for frame in self.sent[since:] if frame["type"] == kind]


@pytest.fixture
def page(browser, request):
    """A fresh browser context (empty localStorage) at desktop size; fails the test on any uncaught page error."""
    options = getattr(request, "param", {"viewport": {"width": 1200, "height": 800}})
    context = browser.new_context(**options)
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.errors = []
    page.dialogs = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    page.frames_seen = Frames(page)
    yield page
    context.close()
    assert page.errors == [], page.errors
    assert page.dialogs == [], page.dialogs


def wait_until(page, condition, timeout=30.0, what="condition") -> None:
    """Let Playwright deliver its events until `condition()` holds (frames arrive as events, not DOM)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        page.wait_for_timeout(20)


def open_chat(page, url: str) -> None:
    page.goto(url + "/")
    expect(page.locator("#swarm-status")).to_have_text(f"{MODEL}: all 4 blocks served by 2 servers")
    expect(page.locator("#session-state")).to_contain_text("connected")


def settings(page, screenshot=None, **values) -> None:
    page.get_by_role("button", name="Settings").click()
    dialog = page.get_by_role("dialog", name="Settings")
    expect(dialog).to_be_visible()
    for name, value in values.items():
        dialog.locator(f"#{name}").fill(str(value))
    if screenshot:
        shot(page, screenshot)
    dialog.get_by_role("button", name="Done").click()
    expect(dialog).to_be_hidden()


def say(page, text: str) -> None:
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")


def finish(page) -> dict:
    """Wait for the reply to end; the last frame the page received."""
    page.wait_for_function(IDLE)
    received = page.frames_seen.received
    wait_until(page, lambda: received and (received[-1].get("stop") or not received[-1]["ok"]), what="the last frame")
    return received[-1]


def shot(page, path: Path) -> None:
    page.screenshot(path=path, animations="disabled")  # a sliding panel is shown where it ends up


def replies(page):
    return page.locator("article.message.assistant")


def stored(page) -> dict:
    return page.evaluate("JSON.parse(localStorage.getItem('swarm-chat/v1'))")


# ------------------------------------------------------------------------------------------ the real swarm


def test_streams_stops_continues_regenerates_and_survives_a_reload(chat_gateway, page, artifacts):
    frames = page.frames_seen
    open_chat(page, chat_gateway.url)
    # greedy, so that the reply is the same every run (and it does not end before the Stop); far more tokens
    # than it will write before the Stop
    settings(page, temperature=0, max_new_tokens=800)
    say(page, "Hello, swarm!")

    # the reply streams in: its text takes at least 3 different non-empty lengths, then Stop ends it
    page.wait_for_function("""() => {
        const body = document.querySelector('article.assistant:last-of-type .body');
        (window.seenLengths ||= new Set()).add(body ? body.textContent.length : 0);
        return [...window.seenLengths].filter(Boolean).length >= 3;
    }""")
    expect(page.locator("#session-state")).to_have_text("generating…")
    page.get_by_role("button", name="Stop the reply").click()
    last = finish(page)
    assert last["stop"] is True and last["finish_reason"] == "cancelled"
    expect(replies(page).last.locator(".note")).to_have_text("Stopped.")
    expect(page.locator("#speed")).to_contain_text("tokens/s")
    expect(page.locator("#session-state")).to_have_text("session open · 1024 tokens")
    [first] = frames.sent_of("generate")
    assert first["messages"] == [{"role": "user", "content": "Hello, swarm!"}] and first["stream"] is True
    assert first["max_reply_tokens"] == 800 and first["temperature"] == 0 and first["do_sample"] is False
    shot(page, artifacts / "chat-stopped.png")

    # a second turn in the same session sends only the new message, with the new temperature
    settings(page, temperature=0.5, max_new_tokens=12)
    mark = len(frames.sent)
    say(page, "And a second question?")
    last = finish(page)
    assert last["ok"] and last["stop"] and last["finish_reason"] in ("length", "stop")
    assert frames.sent_of("open_inference_session", mark) == []
    [second] = frames.sent_of("generate", mark)
    assert second["messages"] == [{"role": "user", "content": "And a second question?"}]
    assert second["temperature"] == 0.5 and second["do_sample"] is True and second["max_reply_tokens"] == 12
    expect(replies(page)).to_have_count(2)

    # regenerate rewinds the session: no history, no new session
    mark = len(frames.sent)
    page.get_by_role("button", name="Regenerate the last reply").click()
    last = finish(page)
    assert last["ok"] and last["stop"]
    [again] = frames.sent_of("generate", mark)
    assert again["regenerate"] is True and "messages" not in again
    assert frames.sent_of("open_inference_session", mark) == []
    expect(replies(page)).to_have_count(2)
    assert len(frames.sent_of("open_inference_session")) == 1

    # a reload keeps the conversation; its next turn opens a new session and sends the history once
    before = stored(page)["conversations"][0]["messages"]
    page.reload()
    expect(page.locator("article.message")).to_have_count(4)
    expect(page.get_by_role("button", name="Hello, swarm!", exact=True)).to_have_attribute("aria-current", "true")
    expect(page.locator("#temperature")).to_have_value("0.5")
    shot(page, artifacts / "chat-reloaded.png")
    mark = len(frames.sent)
    say(page, "Third, after a reload")
    last = finish(page)
    assert last["ok"] and last["stop"]
    assert len(frames.sent_of("open_inference_session", mark)) == 1
    [third] = frames.sent_of("generate", mark)
    history = [{"role": message["role"], "content": message["content"]} for message in before]
    assert [message["role"] for message in history] == ["user", "assistant", "user", "assistant"]
    assert third["messages"] == history + [{"role": "user", "content": "Third, after a reload"}]
    assert third["temperature"] == 0.5
    expect(replies(page)).to_have_count(3)


@pytest.mark.parametrize("page", [{"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True,
                                   "device_scale_factor": 2}], indirect=True)
def test_phone_sized_screen(chat_gateway, page, artifacts):
    open_chat(page, chat_gateway.url)
    prompt, send = page.get_by_label("Message"), page.get_by_role("button", name="Send")
    for control in (prompt, send, page.get_by_role("button", name="Settings")):
        expect(control).to_be_in_viewport()
        box = control.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390 and box["y"] + box["height"] <= 844
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing sticks out sideways
    expect(page.locator("#sidebar")).to_be_hidden()  # the list slides in from the menu button instead

    settings(page, max_new_tokens=10, screenshot=artifacts / "phone-settings.png")
    prompt.tap()
    prompt.fill("Hi from a phone")
    send.tap()
    last = finish(page)
    assert last["ok"] and last["stop"]
    expect(replies(page)).to_have_count(1)
    shot(page, artifacts / "phone-chat.png")

    page.get_by_role("button", name="Show conversations").tap()
    expect(page.get_by_role("button", name="Hi from a phone", exact=True)).to_be_in_viewport()
    shot(page, artifacts / "phone-conversations.png")
    page.get_by_role("log", name="Conversation").tap(position={"x": 370, "y": 400})  # beside the list: it closes
    expect(page.locator("#sidebar")).to_be_hidden()
    page.get_by_role("button", name="Show conversations").tap()
    page.get_by_role("button", name="New conversation").tap()
    expect(page.locator("#sidebar")).to_be_hidden()
    expect(page.locator("article.message")).to_have_count(0)


def test_keyboard_only(chat_gateway, page):
    """Every control is reachable and labelled; Shift+Enter is a new line, Enter sends."""
    open_chat(page, chat_gateway.url)
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('button, input, select, textarea')]
        .filter((el) => !el.getAttribute('aria-label') && !(el.labels && el.labels.length) && !el.textContent.trim())
        .map((el) => el.outerHTML)""")
    assert unlabelled == []
    settings(page, max_new_tokens=6)
    prompt = page.get_by_label("Message")
    prompt.focus()
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    expect(prompt).to_have_value("line one\nline two")
    page.keyboard.press("Enter")
    finish(page)
    expect(page.locator("article.user")).to_have_text("line one\nline two")
    page.keyboard.press("Tab")  # from the message box to the next control, with a visible focus ring
    expect(page.get_by_role("button", name="Regenerate the last reply")).to_be_focused()
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"
    page.keyboard.press("Enter")  # and it works from the keyboard
    finish(page)
    expect(page.locator("article.assistant")).to_have_count(1)


def test_a_gateway_with_keys_asks_for_one_and_chats_with_it(strict_gateway, page, artifacts):
    """conftest.strict_gateway has API keys: the page says so, takes one in its settings, and keeps it."""
    page.goto(strict_gateway.url + "/")
    status = page.locator("#swarm-status")
    expect(status).to_have_text("This gateway needs an API key: enter it in Settings.")
    settings(page, api_key="not-a-key")
    expect(status).to_have_text("The API key in Settings is not valid for this gateway.")
    settings(page, api_key="key-browser", screenshot=artifacts / "chat-api-key.png")
    expect(status).to_have_text(f"{MODEL}: all 4 blocks served by 2 servers")
    expect(page.locator("#session-state")).to_contain_text("connected")
    say(page, "Hello!")
    last = finish(page)
    assert last["ok"] and last["stop"]
    assert page.frames_seen.urls[-1].endswith("/api/v2/generate?api_key=key-browser")  # a browser WebSocket's way
    page.reload()
    expect(status).to_have_text(f"{MODEL}: all 4 blocks served by 2 servers")
    assert stored(page)["settings"]["api_key"] == "key-browser"


# ------------------------------------------------------------------------------------------ a scripted gateway


class FakeGateway:
    """Plays the gateway's side of /api/v2/generate (Playwright's route_web_socket): sessions always open, and
    `on_generate(route, message)` answers each generate. Records each connection's messages."""

    def __init__(self, page, on_generate, on_open=lambda route, message: False):
        self.on_generate, self.on_open = on_generate, on_open
        self.connections: list[tuple[object, list[dict]]] = []
        page.route_web_socket("**/api/v2/generate", self._connect)

    def _connect(self, route) -> None:
        received: list[dict] = []
        self.connections.append((route, received))

        def on_message(raw) -> None:
            message = json.loads(raw)
            received.append(message)
            if message["type"] == "open_inference_session" and self.on_open(route, message):
                return  # on_open answered with an error
            if message["type"] in ("open_inference_session", "close_inference_session"):
                route.send(json.dumps({"ok": True}))
            elif message["type"] == "generate":
                self.on_generate(route, message)

        route.on_message(on_message)

    @staticmethod
    def error(route, code: str, text: str) -> bool:
        route.send(json.dumps({"ok": False, "error": text, "code": code, "traceback": text}))
        return True

    @staticmethod
    def reply(route, pieces, finish_reason="stop") -> None:
        for index, piece in enumerate(pieces):
            last = index == len(pieces) - 1
            frame = {"ok": True, "outputs": piece, "stop": last, "token_count": 1}
            route.send(json.dumps({**frame, "finish_reason": finish_reason} if last else frame))

    def sent(self, connection: int, kind: str) -> list[dict]:
        return [message for message in self.connections[connection][1] if message["type"] == kind]


def test_a_wait_for_missing_blocks_is_shown_and_the_reply_follows(chat_gateway, page):
    """The gateway's waiting frame (no server holds some blocks for a moment) shows as the session's state, adds
    nothing to the reply, and the reply that follows streams as usual."""
    waiting = "no server holds blocks 2..3 of tiny; waiting up to 30 s"
    routes = []

    def on_generate(route, message):
        routes.append(route)
        route.send(json.dumps({"ok": True, "outputs": "", "stop": False, "token_count": 0, "waiting": waiting}))

    FakeGateway(page, on_generate)
    open_chat(page, chat_gateway.url)
    say(page, "Hello?")
    expect(page.locator("#session-state")).to_have_text(waiting)
    FakeGateway.reply(routes[0], ["Back ", "again."])
    page.wait_for_function(IDLE)
    expect(replies(page).last).to_have_text("Back again.")
    expect(page.locator("#session-state")).not_to_have_text(waiting)


def test_model_output_is_shown_as_text_never_as_html(chat_gateway, page, artifacts):
    pieces = ["Look: ", EVIL, " and [a link](javascript:alert(2)) and <script>alert(3)</script>\n\n",
              "```html\n", EVIL, "\n```\n", "See [the docs](https://example.org/docs)."]
    FakeGateway(page, lambda route, message: FakeGateway.reply(route, pieces))
    open_chat(page, chat_gateway.url)
    say(page, "Say something nasty")
    page.wait_for_function(IDLE)
    reply = replies(page).last
    expect(reply).to_contain_text(f"Look: {EVIL} and")
    expect(reply.locator("pre code")).to_have_text(EVIL)
    expect(reply).to_contain_text("<script>alert(3)</script>")
    assert page.locator("article img, article script").count() == 0
    # markdown-it refuses the javascript: link (it stays text); a real link opens in a new tab, with no referrer
    link = reply.get_by_role("link")
    expect(link).to_have_count(1)
    expect(link).to_have_attribute("href", "https://example.org/docs")
    expect(link).to_have_attribute("target", "_blank")
    expect(link).to_have_attribute("rel", "noopener noreferrer nofollow")
    page.evaluate("new Promise((done) => setTimeout(done, 300))")  # time for an onerror to have fired
    assert page.dialogs == []
    shot(page, artifacts / "hostile-reply.png")
    page.emulate_media(color_scheme="dark")
    shot(page, artifacts / "hostile-reply-dark.png")


def test_a_thinking_models_reasoning_is_folded_above_its_answer(chat_gateway, page, artifacts):
    """A reply that thinks ("<think>" ... "</think>", the tags cut across frames) shows its answer, and its
    reasoning folded away, as text (markup in it stays text), to be opened."""
    pieces = ["<thi", "nk>\nthe user ", EVIL, " greets\n</th", "ink>\n\n**Hello** there"]
    FakeGateway(page, lambda route, message: FakeGateway.reply(route, pieces))
    open_chat(page, chat_gateway.url)
    say(page, "Hello?")
    page.wait_for_function(IDLE)
    reply = replies(page).last
    fold = reply.locator("details.reasoning")
    expect(fold).not_to_have_attribute("open", "")
    expect(fold.locator(".reasoning-text")).to_have_text(f"the user {EVIL} greets")
    expect(reply.locator("strong")).to_have_text("Hello")
    expect(reply.locator(".body")).not_to_contain_text("think>")
    fold.locator("summary").click()
    expect(fold.locator(".reasoning-text")).to_be_visible()
    assert page.locator("article img").count() == 0
    shot(page, artifacts / "reasoning-folded.png")


TRACEBACK = 'Traceback (most recent call last):\n  File "gateway/engine.py", line 1\nRuntimeError: boom'


@pytest.mark.parametrize("code, when, text, shown", [
    ("too_many_sessions", "open", "too many open sessions (8)", "serving as many chats as it can"),
    ("not_found", "generate", "inference session 1f2e is closed", "The session expired"),
    ("swarm_unavailable", "generate", TRACEBACK, "The swarm can't run the model right now"),
    ("internal_error", "generate", "internal error (see the gateway's log)", "Something went wrong"),
])
def test_errors_read_as_sentences_and_retry_starts_over(chat_gateway, page, code, when, text, shown):
    failed = []

    def fail_once(route, now) -> bool:
        if now != when or failed:
            return False
        failed.append(now)
        return FakeGateway.error(route, code, text)

    def on_generate(route, message):
        if not fail_once(route, "generate"):
            FakeGateway.reply(route, ["all good"])

    fake = FakeGateway(page, on_generate, on_open=lambda route, message: fail_once(route, "open"))
    page.goto(chat_gateway.url + "/")
    say(page, "hello")
    alert = page.get_by_role("alert")
    expect(alert).to_contain_text(shown)
    assert "Traceback" not in alert.inner_text() and "File " not in alert.inner_text()
    if "\n" not in text:
        expect(alert).to_contain_text(f"The gateway said: {text}")  # the gateway's own clean words, too
    alert.get_by_role("button", name="Retry").click()
    expect(replies(page).last).to_have_text("all good")
    expect(page.get_by_role("alert")).to_have_count(0)
    opens, generates = fake.sent(0, "open_inference_session"), fake.sent(0, "generate")
    assert len(opens) == 2  # the retry starts a new session...
    assert generates[-1]["messages"] == [{"role": "user", "content": "hello"}]  # ...and sends the history once


MODELS = {"ok": True, "default_model": MODEL,
          "models": [{"name": MODEL, "max_session_length": 4096, "num_blocks": 4, "servers": 2, "covered": True,
                      "missing_blocks": None}]}


def test_outgrown_session_is_reopened_twice_as_long_with_the_history(chat_gateway, page):
    page.route("**/api/v1/models", lambda route: route.fulfill(json=MODELS))
    turns = []

    def on_generate(route, message):
        turns.append(message)
        if len(turns) == 2:  # the second turn does not fit the first session
            route.send(json.dumps({"ok": False, "code": "context_length_exceeded", "error": "the inputs need 1100 "
                                   "tokens, over the session's max_length of 1024", "traceback": "same"}))
        else:
            FakeGateway.reply(route, [f"reply {len(turns)}"])

    fake = FakeGateway(page, on_generate)
    page.goto(chat_gateway.url + "/")
    say(page, "first")
    page.wait_for_function(IDLE)
    say(page, "second")
    expect(replies(page).last).to_have_text("reply 3")
    opens = fake.sent(0, "open_inference_session")
    assert [message["max_length"] for message in opens] == [1024, 2048]
    assert turns[1]["messages"] == [{"role": "user", "content": "second"}]
    assert turns[2]["messages"] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "reply 1"},
                                    {"role": "user", "content": "second"}]
    expect(page.locator(".error")).to_have_count(0)
    expect(page.locator("#session-state")).to_have_text("session open · 2048 tokens")


def test_lost_connection_reconnects_and_the_next_turn_resends_the_history(chat_gateway, page, artifacts):
    def on_generate(route, message):
        connection = [index for index, (known, _) in enumerate(fake.connections) if known is route][0]
        if connection == 1:  # the second connection dies in the middle of a reply
            route.send(json.dumps({"ok": True, "outputs": "half a", "stop": False, "token_count": 1}))
            route.close(code=1011, reason="gone")
        else:
            FakeGateway.reply(route, [f"reply on connection {connection}"])

    fake = FakeGateway(page, on_generate)
    page.goto(chat_gateway.url + "/")
    say(page, "first")
    expect(replies(page).last).to_have_text("reply on connection 0")

    fake.connections[0][0].close(code=1001, reason="gateway restarting")  # dropped while idle
    expect(page.locator("#session-state")).to_contain_text("offline")
    wait_until(page, lambda: len(fake.connections) == 2, what="the reconnect")  # after the backoff
    expect(page.locator("#session-state")).to_have_text("connected · no session yet")
    say(page, "second")
    alert = page.get_by_role("alert")
    expect(alert).to_contain_text("Lost the connection to the gateway")
    assert "Traceback" not in alert.inner_text()
    shot(page, artifacts / "connection-lost.png")
    expect(replies(page)).to_have_count(1)  # the broken reply is not kept
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "reply on connection 0"},
               {"role": "user", "content": "second"}]
    assert fake.sent(1, "generate")[0]["messages"] == history  # the new session got the history once

    wait_until(page, lambda: len(fake.connections) == 3, what="the second reconnect")
    alert.get_by_role("button", name="Retry").click()
    expect(replies(page).last).to_have_text("reply on connection 2")
    assert len(fake.sent(2, "open_inference_session")) == 1
    assert fake.sent(2, "generate")[0]["messages"] == history
    expect(page.get_by_role("alert")).to_have_count(0)


# ------------------------------------------------------------------------------------------ last: the swarm goes away


def test_swarm_down_shows_a_readable_error_with_retry(chat_swarm, chat_gateway, page, artifacts):
    open_chat(page, chat_gateway.url)
    for server in chat_swarm.servers:
        server.stop()
    say(page, "Is anyone there?")
    alert = page.get_by_role("alert")
    expect(alert).to_contain_text("The swarm can't run the model right now", timeout=60_000)
    text = alert.inner_text()
    assert "Traceback" not in text and 'File "' not in text
    expect(alert.get_by_role("button", name="Retry")).to_be_visible()
    expect(page.locator("#swarm-status")).to_contain_text("missing")  # refreshed at once after the error
    shot(page, artifacts / "swarm-down.png")
