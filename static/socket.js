// The gateway's WebSocket, /api/v2/generate, with reconnection. The gateway answers one message at a time,
// in order, so every frame belongs to the request at the head of a single queue.

export class GatewayError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code || "internal_error";
  }
}

const FIRST_DELAY_MS = 500;
const MAX_DELAY_MS = 30000;

export class GatewaySocket extends EventTarget {
  constructor(url) {
    super();
    this.url = url;
    this.ws = null;
    this.state = "connecting";
    this.delay = FIRST_DELAY_MS;
    this.timer = null;
    this.pending = null; // {resolve, reject, onFrame} of the request being answered
    this.chain = Promise.resolve(); // requests wait for the previous one's last frame
    this.waiters = []; // callers of ready() while connecting
    // What the gateway holds for this connection: {convId, model, maxLength}, or null. A session dies
    // with its connection, so a reconnect clears it and the next turn sends the history once.
    this.session = null;
    this.connect();
  }

  get connected() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  setState(state, detail = {}) {
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: { state, ...detail } }));
  }

  connect() {
    clearTimeout(this.timer);
    this.timer = null;
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) return; // already connecting or open
    this.setState("connecting");
    const ws = (this.ws = new WebSocket(this.url));
    ws.onopen = () => {
      this.delay = FIRST_DELAY_MS;
      this.setState("connected");
      this.waiters.splice(0).forEach((waiter) => waiter.resolve());
    };
    ws.onmessage = (event) => this.onFrame(event.data);
    ws.onclose = () => {
      if (ws !== this.ws) return;
      this.session = null;
      const lost = new GatewayError("connection_lost", "the connection to the gateway was lost");
      this.waiters.splice(0).forEach((waiter) => waiter.reject(lost));
      this.finish((pending) => pending.reject(lost));
      // exponential backoff, so that a gateway that is down is not hammered by every open tab
      this.timer = setTimeout(() => this.connect(), this.delay);
      this.setState("reconnecting", { inMs: this.delay });
      this.delay = Math.min(this.delay * 2, MAX_DELAY_MS);
    };
  }

  // Another address (a new API key): drop this connection and open one to the new address at once.
  retarget(url) {
    if (url === this.url) return;
    this.url = url;
    const old = this.ws;
    this.ws = null; // so that its close is ignored: no backoff for a change asked for
    if (old) old.close();
    this.session = null;
    this.finish((pending) => pending.reject(new GatewayError("connection_lost", "the API key changed")));
    this.delay = FIRST_DELAY_MS;
    this.connect();
  }

  // Resolves once the socket is open; reconnects at once instead of waiting out the backoff (someone is waiting).
  ready() {
    if (this.connected) return Promise.resolve();
    const waiting = new Promise((resolve, reject) => this.waiters.push({ resolve, reject }));
    this.connect();
    return waiting;
  }

  // Sends a message; resolves with its answer ({ok: true}, or the last frame of a reply, each frame also
  // going to onFrame); rejects with a GatewayError on an error frame or a lost connection.
  call(message, onFrame = null) {
    const run = () =>
      new Promise((resolve, reject) => {
        if (!this.connected) return reject(new GatewayError("connection_lost", "not connected to the gateway"));
        this.pending = { resolve, reject, onFrame };
        this.ws.send(JSON.stringify(message));
      });
    const result = this.chain.then(run, run);
    this.chain = result.catch(() => {});
    return result;
  }

  // Ends the reply being generated; the gateway reads it between two tokens, outside the queue.
  stop() {
    if (this.connected) this.ws.send(JSON.stringify({ type: "stop" }));
  }

  onFrame(raw) {
    let frame;
    try {
      frame = JSON.parse(raw);
    } catch {
      return;
    }
    if (!this.pending) return;
    if (!frame.ok) return this.finish((pending) => pending.reject(new GatewayError(frame.code, frame.error)));
    if (this.pending.onFrame) {
      this.pending.onFrame(frame);
      if (!frame.stop) return;
    }
    this.finish((pending) => pending.resolve(frame));
  }

  finish(settle) {
    const pending = this.pending;
    this.pending = null;
    if (pending) settle(pending);
  }
}
