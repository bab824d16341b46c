// The chat page: conversations kept in localStorage, one inference session per conversation on the gateway's
// WebSocket, replies streamed token by token and rendered as Markdown by markdown-it.
import { GatewaySocket } from "./socket.js";

const $ = (id) => document.getElementById(id);
const STORE_KEY = "swarm-chat/v1";
const DEFAULTS = { model: "", system: "", temperature: 0.6, top_p: 0.9, max_new_tokens: 512, api_key: "" };
// Tokens a conversation's first session reserves on the servers; doubled (up to the model's
// max_session_length) when the conversation outgrows it, as chat.petals.dev did.
const FIRST_SESSION_LENGTH = 1024;
const STATUS_EVERY_MS = 10000;

// html: false escapes raw HTML in a reply, and markdown-it's validateLink refuses javascript:/vbscript: links,
// so model output can never inject markup or script.
// Without it (static/node_modules not installed: `npm ci --prefix static`), replies are shown as plain text.
const md = window.markdownit ? window.markdownit({ html: false, linkify: true, breaks: true }) : null;
if (md) {
  const renderLink = md.renderer.rules.link_open
    || ((tokens, i, options, env, self) => self.renderToken(tokens, i, options));
  md.renderer.rules.link_open = (tokens, i, options, env, self) => {
    tokens[i].attrSet("target", "_blank"); // a link never replaces the conversation...
    tokens[i].attrSet("rel", "noopener noreferrer nofollow"); // ...nor tells the target where it came from
    return renderLink(tokens, i, options, env, self);
  };
} else console.warn("markdown-it is missing: run `npm ci --prefix static`; replies are shown as plain text");

const store = load();
const socket = new GatewaySocket(socketUrl());
let models = [], defaultModel = "";
let busy = false; // a reply is being generated
let inflight = Promise.resolve(); // that reply, so that switching conversations can wait for its end
let problem = null; // {error, retry}: the error shown under the conversation
let reconnectMs = 0;
let stopping = false; // Stop was pressed: also honoured while the session is still being opened

// ------------------------------------------------------------------------------------------ storage

function load() {
  const fresh = { conversations: [], currentId: null, settings: { ...DEFAULTS } };
  try {
    const saved = JSON.parse(localStorage.getItem(STORE_KEY));
    return saved ? { ...fresh, ...saved, settings: { ...DEFAULTS, ...saved.settings } } : fresh;
  } catch {
    return fresh; // unreadable or disabled storage: start empty rather than not at all
  }
}

function save() {
  try {
    localStorage.setItem(STORE_KEY, JSON.stringify(store));
  } catch {
    // quota exceeded or storage disabled: the chat goes on, it just won't survive a reload
  }
}

const current = () => store.conversations.find((conv) => conv.id === store.currentId) || null;
const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8); // randomUUID needs https

// ------------------------------------------------------------------------------------------ talking to the swarm

// A gateway with API keys wants one on every API call. A browser's WebSocket cannot send headers, so there the
// key travels as ?api_key= (the gateway's documented way for browsers); fetch sends it as a bearer token.
function socketUrl() {
  const key = store.settings.api_key.trim();
  const query = key ? `?api_key=${encodeURIComponent(key)}` : "";
  return `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/api/v2/generate${query}`;
}

function authHeaders() {
  const key = store.settings.api_key.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function chosenModel() {
  const name = store.settings.model || defaultModel;
  const named = (wanted) => models.find((model) => model.name === wanted);
  return named(name) || named(defaultModel) || { name: name || undefined }; // no list yet: the gateway's default
}

// Makes sure the connection's session belongs to this conversation. Returns true when it already held the
// conversation (send only the new turn), false when it was just opened (send the history once).
async function ensureSession(conv) {
  await socket.ready();
  const model = chosenModel();
  const held = socket.session;
  if (held && held.convId === conv.id && held.model === model.name) return true;
  const maxLength = Math.min(conv.maxLength || FIRST_SESSION_LENGTH, model.max_session_length || Infinity);
  socket.session = null;
  await socket.call({ type: "open_inference_session", model: model.name, max_length: maxLength });
  socket.session = { convId: conv.id, model: model.name, maxLength };
  conv.maxLength = maxLength;
  return false;
}

// After context_length_exceeded: the next session gets twice the room, if the model allows it.
function grow(conv) {
  const limit = chosenModel().max_session_length || 0;
  const now = socket.session?.maxLength || conv.maxLength || FIRST_SESSION_LENGTH;
  if (now >= limit) return false;
  conv.maxLength = Math.min(now * 2, limit);
  return true;
}

// What a fresh session needs: the system prompt, the earlier turns and the new user message (the model's own
// chat template, applied by the gateway, decides how they are formatted).
function history(conv) {
  const turns = conv.messages.slice(0, -1).map(({ role, content }) => ({ role, content })); // not the reply being made
  const system = store.settings.system.trim();
  return system ? [{ role: "system", content: system }, ...turns] : turns;
}

function sampling() {
  const { temperature, top_p, max_new_tokens } = store.settings;
  // max_new_tokens: 1 makes every frame one token; the reply's own bound is max_reply_tokens
  return {
    stream: true, max_new_tokens: 1, max_reply_tokens: max_new_tokens, temperature, top_p, do_sample: temperature > 0,
  };
}

// Answers the conversation's last user message, streaming the reply into a new assistant message.
async function reply(conv, regenerate) {
  problem = null;
  stopping = false;
  const message = { role: "assistant", content: "" };
  conv.messages.push(message);
  busy = true;
  render();
  const article = $("transcript").querySelector("article:last-of-type");
  let tokens = 0, firstAt = 0;
  const onFrame = (frame) => {
    if (frame.waiting) { // the swarm lost some blocks for a while: say so; the speed clock starts with a token
      $("session-state").textContent = frame.waiting;
      $("session-state").dataset.state = "pending";
      return;
    }
    const now = performance.now();
    firstAt ||= now; // speed counts from the first token: the prompt's prefill is not generation
    message.content += frame.outputs || "";
    tokens += frame.token_count || 0;
    if (tokens > 1 && now > firstAt) showSpeed((tokens - 1) / ((now - firstAt) / 1000));
    if (frame.stop) { // "length" is either our max_reply_tokens or a full session
      const capped = frame.finish_reason === "length" && tokens >= store.settings.max_new_tokens;
      message.finish = capped ? "max_tokens" : frame.finish_reason;
    }
    paintLater(article, message);
  };
  try {
    for (;;) {
      const live = await ensureSession(conv);
      if (stopping) { // stopped before anything was generated: the gateway would ignore the stop now
        socket.session = null; // and this session never got the history
        message.finish = "cancelled";
        break;
      }
      const request = { type: "generate", ...sampling() };
      if (!live) request.messages = history(conv);
      else if (regenerate) request.regenerate = true;
      else request.messages = [conv.messages.at(-2)]; // the servers' caches hold everything before it
      try {
        await socket.call(request, onFrame);
        break;
      } catch (error) {
        if (error.code !== "context_length_exceeded" || !grow(conv)) throw error;
        socket.session = null; // the next pass opens a larger session and sends the history once
        message.content = "";
        tokens = firstAt = 0;
      }
    }
  } catch (error) {
    // A broken reply is not kept, and the gateway's transcript may now differ from ours: the retry starts a
    // new session with the whole history.
    conv.messages.splice(conv.messages.indexOf(message), 1);
    socket.session = null;
    problem = { error, retry: () => startReply(conv, false) };
    if (error.code === "swarm_unavailable") refreshStatus();
  } finally {
    busy = false;
    conv.updated = Date.now();
    save();
    render();
    if (document.activeElement === document.body) $("prompt").focus(); // the Stop button vanished under it
  }
}

function startReply(conv, regenerate) {
  inflight = reply(conv, regenerate);
  return inflight;
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || busy) return;
  $("prompt").value = "";
  let conv = current();
  if (!conv) {
    conv = { id: newId(), title: text.trim().slice(0, 60), messages: [], updated: Date.now() };
    store.conversations.push(conv);
    store.currentId = conv.id;
  }
  conv.messages.push({ role: "user", content: text });
  startReply(conv, false);
}

function regenerateLast() {
  const conv = current();
  if (busy || !conv || !conv.messages.length) return;
  const again = conv.messages.at(-1).role === "assistant"; // else the last reply failed: just answer again
  if (again) conv.messages.pop();
  startReply(conv, again);
}

// Switching away stops the reply and frees the servers' cache; coming back opens a new session.
async function switchTo(id) {
  if (busy) {
    stop();
    await inflight;
  }
  if (socket.session && socket.session.convId !== id) {
    socket.session = null;
    socket.call({ type: "close_inference_session" }).catch(() => {});
  }
  store.currentId = id;
  problem = null;
  save();
  showSidebar(false);
  render();
  $("prompt").focus();
}

async function remove(id) {
  if (store.currentId === id) await switchTo(null);
  store.conversations = store.conversations.filter((conv) => conv.id !== id);
  save();
  render();
}

// ------------------------------------------------------------------------------------------ rendering

const EMPTY = "Ask anything. The model runs across the swarm's servers, a few blocks each.";
const NOTES = {
  cancelled: "Stopped.",
  length: "Cut short: the session is full.",
  max_tokens: "Reached the max new tokens setting.",
};
const EXPLAIN = {
  swarm_unavailable: "The swarm can't run the model right now: some of its blocks have no server. "
    + "Servers may be restarting; try again in a moment.",
  not_found: "The session expired on the gateway. Retry starts a new one and sends the conversation again.",
  context_length_exceeded: "This conversation is longer than the model can hold. "
    + "Start a new conversation, or retry for a shorter reply.",
  too_many_sessions: "The gateway is serving as many chats as it can right now. Try again in a minute.",
  rate_limited: "Too many messages in a short time. Wait a moment, then retry.",
  session_busy: "The session is busy with another request. Try again.",
  connection_lost: "Lost the connection to the gateway. "
    + "The page reconnects by itself; Retry sends the conversation again.",
};

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, onClick, className, ariaLabel) {
  const node = element("button", className, label);
  node.type = "button";
  node.addEventListener("click", onClick);
  if (ariaLabel) node.setAttribute("aria-label", ariaLabel);
  return node;
}

// A thinking model (Qwen3, the DeepSeek-R1 distills) writes its reasoning before "</think>" (after "<think>" when the
// reply opens the block itself): shown folded above the answer, as the gateway's APIs tell the two apart.
function splitReasoning(text) {
  const start = text.trimStart();
  const opened = start.startsWith("<think>");
  if (!opened && !text.includes("</think>")) return { reasoning: null, answer: text };
  const body = opened ? start.slice("<think>".length) : text;
  const close = body.indexOf("</think>");
  if (close < 0) return { reasoning: body.trim(), answer: "" }; // still thinking
  return { reasoning: body.slice(0, close).trim(), answer: body.slice(close + "</think>".length).trimStart() };
}

function reasoningFold(article, text) {
  const fold = element("details", "reasoning");
  fold.open = article.dataset.reasoningOpen === "true"; // the reader's choice outlives the repaint of each token
  fold.addEventListener("toggle", () => { article.dataset.reasoningOpen = String(fold.open); });
  fold.append(element("summary", null, "Reasoning"), element("div", "reasoning-text", text)); // text, never markup
  return fold;
}

function fill(article, message) {
  const body = article.querySelector(".body");
  const markdown = message.role === "assistant" && md; // a person's own text is shown as typed
  const { reasoning, answer } = message.role === "assistant" ? splitReasoning(message.content)
    : { reasoning: null, answer: message.content };
  if (markdown) body.innerHTML = md.render(answer); // safe: see md above
  else body.textContent = answer;
  if (reasoning !== null) body.prepend(reasoningFold(article, reasoning));
  body.classList.toggle("plain", !markdown);
  article.querySelector(".note").textContent = NOTES[message.finish] || "";
}

let painting = false;
function paintLater(article, message) {
  if (painting) return; // one Markdown render per animation frame, however fast tokens come
  painting = true;
  requestAnimationFrame(() => {
    painting = false;
    const log = $("transcript");
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
    fill(article, message);
    if (atBottom) log.scrollTop = log.scrollHeight; // follow the reply unless the reader scrolled up
  });
}

// Only the gateway's own messages are shown, and only when they look like one clean line: a proxy's error
// page or anything resembling a traceback is never put in front of a person.
const detail = (text) => (text && text.length < 300 && !/traceback|\n|<\w/i.test(text) ? text : "");

function render() {
  const conv = current();
  const log = $("transcript");
  const parts = (conv?.messages || []).map((message) => {
    const article = element("article", `message ${message.role}`);
    article.setAttribute("aria-label", message.role === "user" ? "You" : "Model");
    article.append(element("div", "body"), element("p", "note"));
    fill(article, message);
    return article;
  });
  if (!parts.length) parts.push(element("p", "empty", EMPTY));
  if (busy) parts.at(-1).setAttribute("aria-busy", "true");
  if (problem) {
    const box = element("div", "error");
    box.setAttribute("role", "alert");
    box.append(element("p", "", EXPLAIN[problem.error.code] || "Something went wrong while generating the reply."));
    const more = problem.error.code !== "connection_lost" && detail(problem.error.message);
    if (more) box.append(element("p", "detail", `The gateway said: ${more}`));
    const { retry } = problem;
    box.append(button("Retry", retry, "primary retry", "Retry"));
    parts.push(box);
  }
  log.replaceChildren(...parts);
  log.scrollTop = log.scrollHeight;

  $("conversations").replaceChildren(...[...store.conversations].sort((a, b) => b.updated - a.updated).map((item) => {
    const li = element("li");
    const open = button(item.title || "Untitled", () => switchTo(item.id), "open");
    if (item.id === store.currentId) open.setAttribute("aria-current", "true");
    li.append(open, button("×", () => remove(item.id), "icon delete", `Delete conversation: ${item.title}`));
    return li;
  }));
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy || !conv?.messages.length;
  showState();
}

function showState() {
  const held = socket.session && socket.session.convId === store.currentId;
  const [state, text] =
    socket.state === "connecting" ? ["pending", "connecting…"]
    : socket.state === "reconnecting" ? ["down", `offline · retrying in ${Math.ceil(reconnectMs / 1000)} s`]
    : busy ? ["busy", "generating…"]
    : held ? ["open", `session open · ${socket.session.maxLength} tokens`]
    : ["ready", "connected · no session yet"];
  $("session-state").textContent = text;
  $("session-state").dataset.state = state;
}

function showSpeed(rate) {
  $("speed").hidden = false;
  $("speed").textContent = `${rate.toFixed(1)} tokens/s`;
}

// ------------------------------------------------------------------------------------------ swarm status

async function refreshStatus() {
  const line = $("swarm-status");
  try {
    const reply = await fetch("/api/v1/models", { headers: authHeaders(), cache: "no-store" });
    if (reply.status === 401) {
      line.textContent = store.settings.api_key ? "The API key in Settings is not valid for this gateway."
        : "This gateway needs an API key: enter it in Settings.";
      line.dataset.state = "bad";
      return;
    }
    const data = await reply.json();
    if (!data.ok) throw new Error(data.error);
    models = data.models;
    defaultModel = data.default_model;
    const select = $("model");
    const names = models.map((model) => model.name);
    if ([...select.options].map((option) => option.value).join("\n") !== names.join("\n")) {
      select.replaceChildren(...names.map((name) => new Option(name, name)));
    }
    select.value = chosenModel().name;
    const model = chosenModel();
    const servers = `${model.servers} server${model.servers === 1 ? "" : "s"}`;
    line.textContent = model.error ? `${model.name}: unreachable (${detail(model.error) || "see the gateway's log"})`
      : model.covered ? `${model.name}: all ${model.num_blocks} blocks served by ${servers}`
      : `${model.name}: blocks ${model.missing_blocks} missing (${servers} up)`;
    line.dataset.state = model.covered ? "ok" : "bad";
  } catch {
    line.textContent = "Can't reach the gateway to check the swarm.";
    line.dataset.state = "bad";
  }
}

// ------------------------------------------------------------------------------------------ controls

function bindSettings() {
  const dialog = $("settings");
  for (const name of Object.keys(DEFAULTS)) {
    const input = $(name);
    input.value = store.settings[name];
    input.addEventListener("input", () => { // applies to the next message at once
      if (input.type !== "number") store.settings[name] = input.value;
      else if (input.value !== "" && input.checkValidity()) store.settings[name] = Number(input.value);
      save();
      if (name === "model") refreshStatus();
    });
    input.addEventListener("change", () => (input.value = store.settings[name])); // out of range: the last good one
  }
  $("api_key").addEventListener("change", () => { // once typed (not at each keystroke): reconnect with it
    socket.retarget(socketUrl());
    refreshStatus();
  });
  $("open-settings").addEventListener("click", () => dialog.showModal());
}

function stop() {
  stopping = true;
  socket.stop();
}

// On a phone the conversation list slides over the chat; a tap beside it or Escape puts it away.
function showSidebar(open) {
  document.body.classList.toggle("sidebar-open", open);
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { // Shift+Enter: a new line
    event.preventDefault();
    send();
  } else if (event.key === "Escape" && busy) stop();
});
$("stop").addEventListener("click", stop);
$("regenerate").addEventListener("click", regenerateLast);
$("new-chat").addEventListener("click", () => switchTo(null));
$("toggle-sidebar").addEventListener("click", (event) => {
  event.stopPropagation();
  showSidebar(!document.body.classList.contains("sidebar-open"));
});
document.querySelector(".chat").addEventListener("click", () => showSidebar(false));
addEventListener("keydown", (event) => event.key === "Escape" && showSidebar(false));
socket.addEventListener("state", (event) => {
  reconnectMs = event.detail.inMs || 0;
  showState();
});
addEventListener("pagehide", save); // keeps a reply that was still streaming

bindSettings();
render();
refreshStatus();
setInterval(() => document.hidden || refreshStatus(), STATUS_EVERY_MS); // a background tab asks nothing
$("prompt").focus();
