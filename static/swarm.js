// The /swarm page: every served model's servers as bars over its blocks, and a coverage row with its gaps,
// redrawn from /api/v1/swarm every 5 seconds. Everything a server announced (peer ids, versions) comes from
// strangers on the DHT, so it is only ever set as text, never parsed as HTML.
"use strict";

const REFRESH_MS = 5000;
// a browser cannot send headers on a plain page load: /swarm?api_key=KEY passes the key on to the API;
// without one, the key set in the chat page's settings (same origin, same storage)
const API_KEY = new URLSearchParams(location.search).get("api_key") || storedKey();

function storedKey() {
  try {
    return JSON.parse(localStorage.getItem("swarm-chat/v1"))?.settings?.api_key || "";
  } catch {
    return "";
  }
}

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "style") Object.assign(node.style, value);
    else node.setAttribute(name, value);
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

function shortPeer(peerId) {
  return peerId.length > 12 ? "…" + peerId.slice(-8) : peerId;
}

function tokensPerSecond(value) {
  return value >= 100 ? value.toFixed(0) : value.toFixed(1);
}

function blockBar(numBlocks, start, end, state) {
  const bar = el("div", { class: "bar", "aria-label": `blocks ${start} to ${end - 1}, ${state}` });
  bar.style.setProperty("--blocks", numBlocks);
  bar.append(el("div", { class: `span ${state}`, style: { gridColumn: `${start + 1} / ${end + 1}` } },
                `${start}:${end}`));
  return bar;
}

function coverageBar(coverage) {
  const bar = el("div", { class: "bar", "aria-label": "online servers per block" });
  bar.style.setProperty("--blocks", coverage.length);
  coverage.forEach((count, index) => {
    const kind = count === 0 ? "gap" : count === 1 ? "thin" : "";
    bar.append(el("div", { class: `cell ${kind}`, title: `block ${index}: ${count} online server(s)` }, String(count)));
  });
  return bar;
}

function serverRow(model, server, gatewayVersion) {
  const version = el("td", {}, server.version || "?",
    server.compatible === false ? el("span", { class: "relayed" }, " not routed") : null);
  if (server.version !== gatewayVersion) version.title = `the gateway runs ${gatewayVersion}`
    + (server.compatible === false ? ", which cannot talk to this server: upgrade it" : "");
  return el("tr", { class: "server" },
    el("td", { title: server.peer_id }, el("code", {}, shortPeer(server.peer_id)),
       server.relayed ? el("span", { class: "relayed", title: "behind a NAT: reached through a relay (every "
                                     + "message takes a detour, so routing prefers a direct server)" }, " relayed")
                      : null,
       server.caught_lying ? el("span", { class: "relayed", title: "an audit caught it returning wrong outputs: "
                                          + "this gateway routes nothing to it for a day" }, " caught lying")
                           : null),
    el("td", { class: "blocks" }, blockBar(model.num_blocks, server.start, server.end, server.state)),
    el("td", { class: `state ${server.state}` }, server.state),
    el("td", { class: "num" }, server.state === "joining" ? "–" : tokensPerSecond(server.throughput)),
    el("td", { class: "num" }, server.cache_tokens_free.toLocaleString()),
    el("td", { class: "num", title: "round trip from this gateway" },
       typeof server.rtt_ms === "number" ? server.rtt_ms.toFixed(server.rtt_ms >= 10 ? 0 : 1) : "–"),
    version);
}

function modelSection(model, gatewayVersion) {
  const section = el("section", { class: "model", "aria-label": model.name },
    el("h2", {}, model.name, " ", el("span", { class: "muted" }, `(DHT prefix ${model.dht_prefix})`)));
  if (model.error) {
    section.append(el("p", { class: "error" }, `Unavailable: ${model.error}`));
    return section;
  }
  const online = model.servers.filter((server) => server.state === "online").length;
  section.append(el("p", { class: "summary" },
    `${model.num_blocks} blocks, ${online} of ${model.servers.length} servers online. `,
    model.incompatible_servers ? el("span", { class: "bad" },
      `${model.incompatible_servers} of another protocol version, not routed to. `) : null,
    model.covered ? el("span", { class: "good" }, "Every block is served.")
                  : el("span", { class: "bad" }, `No server holds blocks ${model.missing_blocks}.`)));

  const rows = model.servers.map((server) => serverRow(model, server, gatewayVersion));
  rows.push(el("tr", { class: "coverage" },
    el("th", { scope: "row" }, "coverage"),
    el("td", { class: "blocks" }, coverageBar(model.coverage)),
    el("td", { colspan: "5", class: "muted" }, "online servers per block")));
  const titles = ["server", "blocks", "state", "tokens/s", "free cache (tokens)", "latency (ms)", "version"];
  const head = el("tr", {}, ...titles
    .map((title) => el("th", { scope: "col", class: title === "blocks" ? "blocks" : "" }, title)));
  section.append(el("div", { class: "table-wrap" },
    el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows))));
  return section;
}

async function refresh() {
  const updated = document.getElementById("updated");
  const banner = document.getElementById("error");
  try {
    const headers = API_KEY ? { "X-API-Key": API_KEY } : {};
    const reply = await fetch("/api/v1/swarm", { headers, cache: "no-store" });
    const body = await reply.json();
    if (!reply.ok || !body.ok) throw new Error(body.error || `HTTP ${reply.status}`);
    document.getElementById("models").replaceChildren(...body.models.map((model) => modelSection(model, body.version)));
    banner.hidden = true;
    updated.className = "muted";
    updated.textContent = `gateway ${body.version}, updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    banner.textContent = `Cannot read the swarm's health: ${error.message}`;
    banner.hidden = false;
    updated.className = "stale";  // the drawing stays, marked as old
  } finally {
    setTimeout(refresh, REFRESH_MS);  // after the reply, never overlapping a slow one
  }
}

refresh();
