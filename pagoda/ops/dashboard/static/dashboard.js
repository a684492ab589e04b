// The Pagoda dashboard: polls dashboard/snapshot every second and draws it; a click on a recent
// request fetches its waterfall. URLs are relative so that the page works under --root-path.
"use strict";

const POLL_MS = 1000;
const KEY_STORE = "pagoda-api-key";
const SVG_NS = "http://www.w3.org/2000/svg";
const sparks = { prompt: [], generation: [] };
let selected = null;

const $ = (id) => document.getElementById(id);
const fmt = (x, digits = 1) => (x === null || x === undefined ? "-" : Number(x).toFixed(digits));
const pct = (x) => (x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%");
const ms = (s) => (s === null || s === undefined ? "-" : s < 1 ? (1000 * s).toFixed(1) + " ms" : s.toFixed(2) + " s");

function authHeaders() {
  const key = localStorage.getItem(KEY_STORE);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function getJSON(url) {
  const r = await fetch(url, { headers: authHeaders(), cache: "no-store" });
  if (r.status === 401) {
    const err = new Error("unauthorized");
    err.unauthorized = true;
    throw err;
  }
  const body = await r.json();
  if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
  return body;
}

function askForKey(message) {
  $("board").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("server-status").textContent = "API key needed";
  $("api-key").focus();
}

function setText(id, text) {
  const el = $(id);
  if (el.textContent !== String(text)) el.textContent = text;
}

function drawSpark(id, values) {
  const svg = $(id);
  const max = Math.max(1, ...values);
  const pts = values.map((v, i) => `${(i * 120) / Math.max(1, values.length - 1)},${30 - (28 * v) / max}`);
  svg.innerHTML = `<polyline points="${pts.join(" ")}"></polyline>`;
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function renderTenants(tenants) {
  const body = document.querySelector("#tenants tbody");
  body.replaceChildren(...tenants.map((t) => {
    const tr = document.createElement("tr");
    tr.dataset.tenant = t.tenant;
    tr.append(cell(t.tenant), cell(t.in_flight), cell(t.requests), cell(t.prompt_tokens),
              cell(t.generation_tokens), cell(fmt(t.generation_tokens_per_s)));
    return tr;
  }));
}

function renderRecent(rows) {
  const body = document.querySelector("#recent tbody");
  body.replaceChildren(...rows.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.requestId = r.request_id;
    tr.dataset.status = r.status;
    if (r.request_id === selected) tr.className = "selected";
    tr.append(cell(r.request_id), cell(r.tenant || "-"), cell(r.status, "status-" + r.status),
              cell(r.prompt_tokens), cell(r.generation_tokens), cell(ms(r.ttft)), cell(ms(r.e2e)),
              cell(r.finish_reason || "-"));
    tr.addEventListener("click", () => showTimeline(r.request_id));
    return tr;
  }));
}

function render(s) {
  $("key-form").hidden = true;
  $("board").hidden = false;
  setText("model", s.model);
  const badge = $("server-status");
  badge.textContent = s.status;
  badge.className = "badge " + s.status;
  setText("updated", "updated " + new Date(s.time * 1000).toLocaleTimeString());
  setText("running", s.running);
  setText("waiting", s.waiting);
  setText("kv-usage", pct(s.kv_cache_usage_perc));
  $("kv-bar").style.width = (100 * s.kv_cache_usage_perc).toFixed(1) + "%";
  setText("prompt-tps", fmt(s.prompt_tokens_per_s));
  setText("generation-tps", fmt(s.generation_tokens_per_s));
  for (const [name, value] of [["prompt", s.prompt_tokens_per_s], ["generation", s.generation_tokens_per_s]]) {
    sparks[name].push(value);
    if (sparks[name].length > 60) sparks[name].shift();
    drawSpark(name + "-spark", sparks[name]);
  }
  setText("hit-rate", pct(s.prefix_cache_hit_rate));
  setText("hit-rate-total", pct(s.prefix_cache_hit_rate_total));
  const t = s.totals;
  setText("preemptions", t.preemptions);
  setText("preemptions-window", s.preemptions_in_window);
  $("spec-card").hidden = !s.spec_decode;
  if (s.spec_decode) {
    setText("spec-acceptance", pct(s.spec_decode.acceptance_rate));
    setText("spec-acceptance-total", pct(s.spec_decode.acceptance_rate_total));
  }
  setText("requests-finished", t.requests_finished);
  const by = t.requests_by_reason;
  setText("requests-by-reason", `${by.stop} / ${by.length} / ${by.abort}`);
  setText("prompt-tokens-total", t.prompt_tokens);
  setText("generation-tokens-total", t.generation_tokens);
  setText("latency-window", `(last ${Math.round(s.window_s)} s)`);
  for (const tr of document.querySelectorAll("#latency tr[data-latency]")) {
    const l = s.latency[tr.dataset.latency];
    const tds = tr.querySelectorAll("td");
    [ms(l.p50), ms(l.p90), ms(l.p99), l.count].forEach((v, i) => { tds[i].textContent = v; });
  }
  renderTenants(s.tenants);
  renderRecent(s.recent_requests);
}

function drawWaterfall(sequence) {
  const segs = sequence.segments;
  const rowH = 18, left = 270, width = 560, top = 18;
  const span = Math.max(1e-6, ...segs.map((g) => g.end));
  const x = (t) => left + (width * t) / span;
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", "waterfall");
  svg.setAttribute("width", left + width + 90);
  svg.setAttribute("height", top + rowH * segs.length + 6);
  const axis = document.createElementNS(SVG_NS, "text");
  axis.setAttribute("x", left);
  axis.setAttribute("y", 12);
  axis.textContent = `0 … ${ms(span)} after arrival`;
  svg.append(axis);
  segs.forEach((g, i) => {
    const y = top + i * rowH;
    const label = document.createElementNS(SVG_NS, "text");
    label.setAttribute("x", 0);
    label.setAttribute("y", y + 12);
    label.textContent = g.label;
    const rect = document.createElementNS(SVG_NS, "rect");
    rect.setAttribute("class", g.kind);
    rect.dataset.kind = g.kind;
    if (g.tokens !== undefined && g.tokens !== null) rect.dataset.tokens = g.tokens;
    rect.setAttribute("x", x(g.start));
    rect.setAttribute("y", y + 2);
    rect.setAttribute("width", Math.max(2, x(g.end) - x(g.start)));
    rect.setAttribute("height", rowH - 5);
    const title = document.createElementNS(SVG_NS, "title");
    title.textContent = `${g.label}: ${ms(g.start)} → ${ms(g.end)}${g.open ? " (ongoing)" : ""}`;
    rect.append(title);
    const dur = document.createElementNS(SVG_NS, "text");
    dur.setAttribute("x", x(g.end) + 4);
    dur.setAttribute("y", y + 12);
    dur.textContent = g.kind === "finish" || g.kind === "cache_hit" ? "" : ms(g.end - g.start);
    svg.append(label, rect, dur);
  });
  return svg;
}

async function showTimeline(requestId) {
  selected = requestId;
  for (const tr of document.querySelectorAll("#recent tbody tr")) {
    tr.classList.toggle("selected", tr.dataset.requestId === requestId);
  }
  $("timeline").hidden = false;
  setText("timeline-title", requestId);
  const body = $("timeline-body");
  body.textContent = "loading…";
  try {
    const w = await getJSON(`dashboard/requests/${encodeURIComponent(requestId)}/waterfall`);
    if (selected !== requestId) return;
    setText("timeline-status", w.sequences.map((q) => q.status).join(", "));
    body.replaceChildren(...w.sequences.map((q) => {
      const div = document.createElement("div");
      div.className = "sequence";
      div.dataset.requestId = q.request_id;
      if (w.sequences.length > 1) {
        const h = document.createElement("h3");
        h.textContent = q.request_id;
        div.append(h);
      }
      div.append(drawWaterfall(q));
      return div;
    }));
  } catch (e) {
    if (e.unauthorized) return askForKey("The API key was refused.");
    body.textContent = "No timeline: " + e.message;
  }
}

async function poll() {
  try {
    render(await getJSON("dashboard/snapshot"));
  } catch (e) {
    if (e.unauthorized) {
      const had = localStorage.getItem(KEY_STORE);
      localStorage.removeItem(KEY_STORE);
      askForKey(had ? "The API key was refused." : "");
      return; // polling resumes once a key is entered
    }
    const badge = $("server-status");
    badge.textContent = "unreachable";
    badge.className = "badge error";
  }
  setTimeout(poll, POLL_MS);
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  localStorage.setItem(KEY_STORE, key);
  $("api-key").value = "";
  $("key-form").hidden = true;
  poll();
});

poll();
