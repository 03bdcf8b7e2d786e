// The console: a client of the HTTP API that exists (POST /v1/functions/{id}, the SSE stream).

import { call, ApiError, adoptFragmentToken, setToken, setFailureHandler } from "./api.js";
import { openStream } from "./sse.js";
import { el, clear, json, usd, ago } from "./render.js";
import { renderTranscript, statusIcon, textOf, PAGE } from "./chat.js";
import { buildTurn, renderWaterfall, nestChild } from "./waterfall.js";

/** @param {string} id */
const $ = (id) => /** @type {HTMLElement} */ (document.getElementById(id));

const LIST_REFRESH_MS = 10000;

const S = {
  /** @type {any} */ catalog: null,
  /** @type {any[]} */ sessions: [],
  /** @type {any[]} */ approvals: [],
  /** @type {any} */ open: null,
  /** The parent chain while a child is viewed (breadcrumb). @type {string[]} */ trail: [],
};

// --- errors and the token -----------------------------------------------------------------

/** @param {ApiError} e */
function showError(e) {
  if (e.status === 401) {
    showTokenForm();
    return;
  }
  $("banner-text").textContent = `${e.code}: ${e.apiMessage}`;
  $("banner").hidden = false;
}

function showTokenForm() {
  connState({ state: "unauthorized" });
  /** @type {HTMLInputElement} */ ($("token-input")).value = "";
  $("token-form").hidden = false;
  $("token-input").focus();
}

setFailureHandler(showError);

$("banner-close").addEventListener("click", () => {
  $("banner").hidden = true;
});

$("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const t = /** @type {HTMLInputElement} */ ($("token-input")).value.trim();
  if (!t) return;
  setToken(t);
  $("token-form").hidden = true;
  start();
});

// --- connection state ---------------------------------------------------------------------

/** @param {{state: string, attempt?: number, message?: string}} s */
function connState(s) {
  const c = $("conn");
  c.dataset.state = s.state;
  const text = {
    connecting: "◌ connecting",
    live: "● live",
    reconnecting: `↻ reconnecting (attempt ${s.attempt || 1})`,
    gone: `✖ server gone (retrying, attempt ${s.attempt || 1})`,
    too_many: "✖ too many open streams: retrying every 5 s",
    unauthorized: "✖ token required",
    missing: "✖ " + (s.message || "no such session"),
    idle: "○ idle",
  }[s.state] || s.state;
  c.textContent = text;
}

// --- the catalog and the picker -----------------------------------------------------------

const KEY_VARS = { anthropic: "ANTHROPIC_API_KEY", openai: "OPENAI_API_KEY", "openai-responses": "OPENAI_API_KEY" };

async function loadCatalog() {
  S.catalog = await call("router::models::list", {});
  const prov = /** @type {HTMLSelectElement} */ ($("provider"));
  clear(prov);
  const providers = [...new Set(S.catalog.models.map((/** @type {any} */ m) => m.provider).concat(S.catalog.providers))];
  providers.sort((a, b) => Number(!S.catalog.providers.includes(a)) - Number(!S.catalog.providers.includes(b)) || a.localeCompare(b));
  for (const p of providers) {
    const ok = S.catalog.providers.includes(p);
    prov.appendChild(el("option", { value: p }, ok ? p : `${p} (not configured)`));
  }
  const def = S.catalog.models.find((/** @type {any} */ m) => m.default && S.catalog.providers.includes(m.provider) && m.provider === "scripted")
    || S.catalog.models.find((/** @type {any} */ m) => m.default && S.catalog.providers.includes(m.provider));
  if (def) prov.value = def.provider;
  fillModels();
  try {
    const agents = await call("directory::agents::list", {}, { quiet: true });
    const sel = /** @type {HTMLSelectElement} */ ($("agent"));
    while (sel.options.length > 1) sel.remove(1);
    for (const a of agents.agents || []) sel.appendChild(el("option", { value: a.name }, a.name + (a.description ? " — " + a.description : "")));
  } catch (_) {
    // no directory: the picker keeps "(none)"
  }
}

function fillModels() {
  const p = /** @type {HTMLSelectElement} */ ($("provider")).value;
  const sel = /** @type {HTMLSelectElement} */ ($("model"));
  clear(sel);
  const configured = S.catalog.providers.includes(p);
  const models = S.catalog.models.filter((/** @type {any} */ m) => m.provider === p);
  const reason = configured ? "" : `no ${KEY_VARS[/** @type {keyof typeof KEY_VARS} */ (p)] || "configuration for " + p} in the server's environment`;
  for (const m of models) {
    const price = m.pricing ? ` · $${m.pricing.input}/$${m.pricing.output} per Mtok` : "";
    const ctx = m.context_window ? ` · ${Math.round(m.context_window / 1000)}k ctx` : "";
    const label = `${m.name || m.id}${ctx}${price}` + (configured ? "" : ` — unavailable: ${reason}`);
    const o = el("option", { value: m.id, disabled: !configured, "data-reason": reason || null }, label);
    if (m.default && configured) /** @type {HTMLOptionElement} */ (o).selected = true;
    sel.appendChild(o);
  }
  if (configured && !models.length) sel.appendChild(el("option", { value: "" }, "(the provider's default model)"));
  // Nothing selectable: still show the first model (disabled) rather than an empty box.
  if (!configured && sel.options.length) sel.selectedIndex = 0;
  $("model-note").textContent = configured ? "" : "⚠ " + reason;
  updateSend();
}

$("provider").addEventListener("change", fillModels);
$("model").addEventListener("change", updateSend);

// --- session list -------------------------------------------------------------------------

let listTimer = 0;
let listPending = false;

let listAgain = false;

async function refreshList() {
  // One request at a time; a refresh asked for meanwhile runs once the current one is done,
  // so the last event's state is never lost.
  if (listPending) {
    listAgain = true;
    return;
  }
  listPending = true;
  try {
    const [list, appr] = await Promise.all([
      call("session::list", { limit: 500 }, { quiet: true }),
      call("approval::list", {}, { quiet: true }),
    ]);
    S.sessions = list.sessions || [];
    S.approvals = appr.approvals || [];
    renderList();
    if (S.open && S.open.id) scheduleRender();
    const badge = $("approvals-badge");
    badge.hidden = S.approvals.length === 0;
    badge.textContent = `⚠ ${S.approvals.length} pending approval${S.approvals.length === 1 ? "" : "s"}`;
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) showTokenForm();
  } finally {
    listPending = false;
    if (listAgain) {
      listAgain = false;
      refreshList();
    }
  }
}

function scheduleList() {
  clearTimeout(listTimer);
  listTimer = window.setTimeout(() => refreshList().finally(scheduleList), LIST_REFRESH_MS);
}

let listDebounce = 0;
function refreshListSoon() {
  clearTimeout(listDebounce);
  listDebounce = window.setTimeout(refreshList, 300);
}

/** @param {any} s */
function sessionLabel(s) {
  return s.title || s.preview || s.session_id;
}

function renderList() {
  const ul = $("session-list");
  const q = /** @type {HTMLInputElement} */ ($("filter")).value.trim().toLowerCase();
  const failedOnly = /** @type {HTMLInputElement} */ ($("failed-only")).checked;
  const pending = new Set(S.approvals.map((a) => a.session_id));
  const rows = S.sessions
    .filter((s) => !s.parent_session_id && !(s.metadata && s.metadata.parent_session_id))
    .filter((s) => !q || (s.title || "").toLowerCase().includes(q) || s.session_id.toLowerCase().includes(q) || (s.preview || "").toLowerCase().includes(q))
    .filter((s) => !failedOnly || s.status === "error")
    .sort((a, b) => b.updated_at - a.updated_at);
  clear(ul);
  if (!rows.length) ul.appendChild(el("li", { class: "muted" }, S.sessions.length ? "no session matches" : "no sessions yet"));
  for (const s of rows) {
    const current = S.open && (S.open.id === s.session_id || S.trail[0] === s.session_id);
    ul.appendChild(el("li", {},
      el("button", { type: "button", class: "session-item", "data-session": s.session_id, "aria-current": current ? "true" : null, onclick: () => openSession(s.session_id) },
        el("span", { class: "s-title" }, sessionLabel(s)),
        el("span", { class: "s-meta" },
          `${statusIcon(s.status)} ${s.status}`,
          s.model ? ` · ${s.model}` : "",
          s.cost_usd !== undefined ? ` · ${usd(s.cost_usd)}` : "",
          pending.has(s.session_id) || s.has_pending_approval ? " · ⚠ approval" : "",
          ` · ${ago(s.updated_at)}`),
      )));
  }
}

$("filter").addEventListener("input", renderList);
$("failed-only").addEventListener("change", renderList);
$("approvals-badge").addEventListener("click", () => {
  const a = S.approvals[0];
  if (a) openSession(a.session_id);
});

// --- the open session ---------------------------------------------------------------------

function newView(/** @type {string|null} */ id, /** @type {boolean} */ readOnly) {
  return {
    id,
    stream: /** @type {any} */ (null),
    events: /** @type {any[]} */ ([]),
    cache: new Map(),
    /** First message-added and last message-updated `at_ms` per entry. */
    times: new Map(),
    entries: new Map(),
    results: new Map(),
    approvals: new Map(),
    latestTurn: /** @type {string|null} */ (null),
    turnStatus: new Map(),
    running: false,
    stopping: false,
    shown: PAGE,
    readOnly,
    askState: new Map(),
    queued: 0,
    /** @type {{text: string, before: number}[]} */ queuedTexts: [],
    onApprove: decide,
    onAnswer: (/** @type {string} */ text) => send(text),
    onOpenChild: (/** @type {string} */ child) => openChild(child),
    onWaterfall: (/** @type {string} */ t) => showWaterfall(t),
    // A spawn's child session, found by the spawning call recorded in the child's metadata.
    childOf: (/** @type {string} */ callId) => {
      const c = S.sessions.find((s) => s.metadata && s.metadata.parent_session_id === id && s.metadata.function_call_id === callId);
      return c ? c.session_id : undefined;
    },
  };
}

function closeOpen() {
  if (S.open && S.open.stream) S.open.stream.close();
}

function newChat() {
  closeOpen();
  S.trail = [];
  S.open = newView(null, false);
  history.replaceState(null, "", location.pathname + location.search);
  $("chat-title").textContent = "New chat";
  $("breadcrumb").hidden = true;
  $("session-status").textContent = "";
  $("agent").hidden = false;
  $("agent-label").hidden = false;
  clear($("transcript"));
  connState({ state: "idle" });
  showEmpty();
  renderList();
  updateControls();
  $("message").focus();
}

$("new-chat").addEventListener("click", newChat);

function showEmpty() {
  const e = $("empty");
  if (S.open && S.open.id) {
    e.hidden = true;
    return;
  }
  clear(e);
  const real = (S.catalog ? S.catalog.providers : []).filter((/** @type {string} */ p) => p !== "scripted");
  e.appendChild(el("p", {}, "Start a chat: pick a provider and model below and send a message."));
  e.appendChild(el("p", {}, "Configured providers: " + (S.catalog ? S.catalog.providers.join(", ") : "…") + "."));
  e.appendChild(el("p", {}, real.length
    ? "The scripted demo answers when you pick the scripted provider."
    : "No API key is set on the server, so the scripted demo (a bundled script, not a model) answers; set ANTHROPIC_API_KEY or OPENAI_API_KEY where the server runs to use a real model."));
  e.hidden = false;
}

/** @param {string} id @param {{readOnly?: boolean}} [opts] */
async function openSession(id, opts = {}) {
  closeOpen();
  if (!opts.readOnly) S.trail = [];
  const v = newView(id, !!opts.readOnly);
  S.open = v;
  if (!opts.readOnly) history.replaceState(null, "", "#session=" + encodeURIComponent(id));
  $("chat-title").textContent = id;
  $("empty").hidden = true;
  $("agent").hidden = true;
  $("agent-label").hidden = true;
  clear($("transcript"));
  renderBreadcrumb();
  renderList();
  updateControls();
  let meta;
  try {
    meta = await call("session::get", { session_id: id }, { quiet: true });
  } catch (e) {
    if (S.open !== v) return;
    if (e instanceof ApiError && e.status === 404) return showMissing(id, e.apiMessage);
    if (e instanceof ApiError) showError(e);
    return;
  }
  if (S.open !== v) return;
  if (!meta) return showMissing(id, `no session '${id}'`);
  $("chat-title").textContent = meta.title || id;
  setSessionStatus(meta.status);
  v.stream = openStream(id, {
    onEvent: (ev) => onEvent(v, ev),
    onState: (s) => {
      if (S.open !== v) return;
      connState(s);
      // Back after a gap: what is not in the event log (pending approvals, totals) is re-read.
      if (s.state === "live") {
        refreshApprovals(v);
        refreshTotals(v);
      }
      if (s.state === "unauthorized") showTokenForm();
      if (s.state === "missing") showMissing(id, s.message || "");
    },
  });
}

/** @param {string} id @param {string} message */
function showMissing(id, message) {
  const t = $("transcript");
  clear(t);
  t.appendChild(el("div", { class: "missing" },
    el("p", {}, `no session ${id}: ${message}`),
    el("button", { type: "button", onclick: newChat }, "Back to the session list")));
  connState({ state: "missing", message: "no session " + id });
}

function renderBreadcrumb() {
  const b = $("breadcrumb");
  clear(b);
  if (!S.trail.length) {
    b.hidden = true;
    return;
  }
  b.hidden = false;
  S.trail.forEach((id, i) => {
    b.appendChild(el("button", { type: "button", class: "link-button crumb", onclick: () => {
      const trail = S.trail.slice(0, i);
      if (i === 0) openSession(id);
      else {
        S.trail = trail;
        openSession(id, { readOnly: true });
      }
    } }, (i === 0 ? "← " : "") + id));
    b.appendChild(document.createTextNode(" › "));
  });
  b.appendChild(el("span", { "aria-current": "page" }, S.open ? S.open.id : ""));
}

/** @param {string} child */
function openChild(child) {
  if (S.open && S.open.id) S.trail.push(S.open.id);
  openSession(child, { readOnly: true });
}

/** @param {string} s */
function setSessionStatus(s) {
  $("session-status").textContent = s ? `${statusIcon(s)} ${s}` : "";
  $("session-status").dataset.status = s || "";
}

let renderQueued = false;
function scheduleRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    const v = S.open;
    if (!v) return;
    const t = $("transcript");
    const atBottom = t.scrollHeight - t.scrollTop - t.clientHeight < 40;
    renderTranscript(t, v, v.cache);
    showQueued(v);
    if (atBottom) t.scrollTop = t.scrollHeight;
    updateControls();
  });
}

/** How many user entries say exactly this. @param {any} v @param {string} text */
function userCount(v, text) {
  let n = 0;
  for (const e of v.entries.values()) if (e.message && e.message.role === "user" && textOf(e.message) === text) n++;
  return n;
}

/** Messages sent while a turn ran, until the transcript holds them. @param {any} v */
function showQueued(v) {
  v.queuedTexts = v.queuedTexts.filter((/** @type {any} */ q) => userCount(v, q.text) <= q.before);
  const ul = $("queued");
  clear(ul);
  for (const q of v.queuedTexts) ul.appendChild(el("li", {}, "◷ queued: ", q.text));
}

$("transcript").addEventListener("scroll", () => {
  const t = $("transcript");
  if (t.scrollTop < 40 && S.open && t.querySelector("button.older")) {
    const before = t.scrollHeight;
    S.open.shown += PAGE;
    renderTranscript(t, S.open, S.open.cache);
    t.scrollTop += t.scrollHeight - before; // keep the reader where they were
  }
});

$("transcript").addEventListener("click", (ev) => {
  const target = /** @type {HTMLElement} */ (ev.target);
  if (target && target.dataset && target.dataset.older && S.open) {
    S.open.shown += PAGE;
    scheduleRender();
  }
});

/** @param {any} v @param {any} ev */
function onEvent(v, ev) {
  if (S.open !== v) return;
  v.events.push(ev);
  const p = ev.payload || {};
  switch (ev.topic) {
    case "session::message-added":
    case "session::message-updated": {
      const t = v.times.get(p.entry_id) || { added: ev.at_ms, updated: ev.at_ms };
      if (ev.topic === "session::message-added") t.added = Math.min(t.added, ev.at_ms);
      t.updated = Math.max(t.updated, ev.at_ms);
      if (p.entry_id) v.times.set(p.entry_id, t);
      const e = ev.entry;
      if (!e) break;
      const old = v.entries.get(e.entry_id);
      if (old && old.revision > e.revision) break;
      v.entries.set(e.entry_id, e);
      if (e.message && e.message.role === "function_result") v.results.set(e.message.function_call_id, e);
      scheduleRender();
      break;
    }
    case "harness::turn-started":
      v.latestTurn = p.turn_id;
      v.turnStatus.set(p.turn_id, "running");
      v.running = true;
      v.queued = 0;
      scheduleRender();
      refreshListSoon();
      if (S.drawerKind === "tree") showTree();
      break;
    case "harness::turn-completed": {
      v.turnStatus.set(p.turn_id, p.status);
      if (p.turn_id === v.latestTurn) {
        v.running = false;
        v.stopping = false;
      }
      scheduleRender();
      refreshListSoon();
      refreshTotals(v);
      if (S.drawerKind === "tree") showTree();
      // Announce the finished reply once (not every delta).
      const last = [...v.entries.values()].filter((e) => e.message && e.message.role === "assistant" && e.origin && e.origin.turn_id === p.turn_id).pop();
      if (last) $("announce").textContent = "Reply finished: " + textOf(last.message).slice(0, 200);
      break;
    }
    case "session::status-changed":
      setSessionStatus(p.status);
      refreshListSoon();
      if (p.status === "working") v.running = true;
      updateControls();
      break;
    case "harness::message-queued":
      v.queued += 1;
      updateControls();
      break;
    case "approval::requested":
    case "approval::decided":
      refreshApprovals(v);
      refreshListSoon();
      break;
    default:
      break;
  }
}

/** @param {any} v */
async function refreshApprovals(v) {
  if (!v.id || v.readOnly) return;
  try {
    const a = await call("approval::list", { session_id: v.id }, { quiet: true });
    if (S.open !== v) return;
    v.approvals = new Map((a.approvals || []).map((/** @type {any} */ x) => [x.function_call_id, x]));
    scheduleRender();
  } catch (_) {
    // shown on the next list refresh
  }
}

/** @param {any} v */
async function refreshTotals(v) {
  if (!v.id) return;
  try {
    const m = await call("harness::metrics", { root_session_id: v.id }, { quiet: true });
    if (S.open !== v) return;
    const t = m.totals || {};
    $("totals").textContent = `session tree: ${usd(t.cost_usd)} · in ${t.input_tokens ?? 0} · out ${t.output_tokens ?? 0} tokens`;
    $("totals").dataset.cost = String(t.cost_usd ?? "");
  } catch (_) {
    $("totals").textContent = "";
  }
}

/** @param {any} a @param {string} decision @param {string} reason */
async function decide(a, decision, reason) {
  const v = S.open;
  try {
    const req = { approval_id: a.approval_id, decision, digest: a.digest };
    if (reason.trim()) /** @type {any} */ (req).reason = reason.trim();
    await call("approval::decide", req);
  } catch (_) {
    // the banner shows the refusal; the card re-reads the list
  }
  if (v) refreshApprovals(v);
  refreshList();
}

// --- composer -------------------------------------------------------------------------------

function modelChoice() {
  const provider = /** @type {HTMLSelectElement} */ ($("provider")).value;
  const sel = /** @type {HTMLSelectElement} */ ($("model"));
  const opt = sel.selectedOptions[0];
  return { provider, model: sel.value, ok: !!opt && !opt.disabled };
}

function updateSend() {
  const text = /** @type {HTMLTextAreaElement} */ ($("message")).value;
  const readOnly = !!(S.open && S.open.readOnly);
  /** @type {HTMLButtonElement} */ ($("send")).disabled = readOnly || text.trim() === "" || !modelChoice().ok;
}

function updateControls() {
  updateSend();
  const v = S.open;
  const stop = /** @type {HTMLButtonElement} */ ($("stop"));
  stop.hidden = !(v && v.id && v.running && !v.readOnly);
  stop.disabled = !!(v && v.stopping);
  stop.textContent = v && v.stopping ? "stopping" : "Stop";
  $("composer").hidden = !!(v && v.readOnly);
  $("read-only-note").hidden = !(v && v.readOnly);
  const queued = v && v.running && v.queued;
  $("composer-error").dataset.kind = queued ? "queued" : "error";
  $("composer-error").textContent = queued ? `${v.queued} message(s) queued: they steer the running turn` : $("composer-error").dataset.error || "";
}

$("message").addEventListener("input", () => {
  $("composer-error").dataset.error = "";
  updateControls();
});
$("message").addEventListener("keydown", (ev) => {
  const k = /** @type {KeyboardEvent} */ (ev);
  if (k.key === "Enter" && !k.shiftKey && !k.isComposing) {
    ev.preventDefault();
    if (!(/** @type {HTMLButtonElement} */ ($("send")).disabled)) sendComposer();
  }
});
$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sendComposer();
});

function sendComposer() {
  const box = /** @type {HTMLTextAreaElement} */ ($("message"));
  const text = box.value;
  if (!text.trim()) return;
  send(text).then((ok) => {
    if (ok) {
      box.value = "";
      updateControls();
    }
  });
}

/** @param {string} text @returns {Promise<boolean>} */
async function send(text) {
  const v = S.open;
  const { provider, model, ok } = modelChoice();
  if (!ok) return false;
  /** @type {any} */
  const req = { message: text, provider };
  if (model) req.model = model;
  if (v && v.id) req.session_id = v.id;
  const agent = /** @type {HTMLSelectElement} */ ($("agent")).value;
  /** @type {any} */
  const options = {};
  if (!(v && v.id) && agent) options.agent = agent;
  // Deny-by-default holds: the model calls only what the operator names here (as `chat --allow`).
  const allow = /** @type {HTMLInputElement} */ ($("allow")).value.split(/[\s,]+/).filter(Boolean);
  if (allow.length) options.functions = { allow };
  if (Object.keys(options).length) req.options = options;
  let r;
  try {
    r = await call("harness::send", req, { quiet: true });
  } catch (e) {
    if (e instanceof ApiError) {
      $("composer-error").dataset.error = `${e.code}: ${e.apiMessage}`;
      $("composer-error").textContent = `${e.code}: ${e.apiMessage}`;
      if (e.status === 401) showTokenForm();
    }
    return false;
  }
  $("composer-error").dataset.error = "";
  // Only the server knows whether the message started a turn or waits for the running one.
  if (v && v.id && (r.queued || r.merged)) {
    v.queuedTexts.push({ text, before: userCount(v, text) });
    scheduleRender();
  }
  if (!(v && v.id)) {
    await openSession(r.session_id);
    refreshList();
  }
  return true;
}

$("stop").addEventListener("click", async () => {
  const v = S.open;
  if (!v || !v.id) return;
  v.stopping = true;
  updateControls();
  try {
    await call("harness::stop", { session_id: v.id });
  } catch (_) {
    v.stopping = false;
    updateControls();
  }
});

// --- drawers: system prompt, sub-agent tree, waterfall --------------------------------------

/** @type {any} */ (S).drawerKind = "";

/** @param {string} kind @param {string} title @param {Node} body */
function openDrawer(kind, title, body) {
  /** @type {any} */ (S).drawerKind = kind;
  $("drawer-title").textContent = title;
  const b = $("drawer-body");
  clear(b);
  b.appendChild(body);
  $("drawer").hidden = false;
  $("drawer").dataset.kind = kind;
  $("drawer-close").focus();
}

function closeDrawer() {
  /** @type {any} */ (S).drawerKind = "";
  $("drawer").hidden = true;
}

$("drawer-close").addEventListener("click", closeDrawer);
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Escape" && !$("drawer").hidden) closeDrawer();
});

$("prompt-open").addEventListener("click", async () => {
  const v = S.open;
  /** @type {any} */
  let req = { selected_prompt: {} };
  if (v && v.id) req = { session_id: v.id };
  else {
    const agent = /** @type {HTMLSelectElement} */ ($("agent")).value;
    if (agent) req.selected_prompt.agent = agent;
  }
  let p;
  try {
    p = await call("harness::system-prompt::get", req);
  } catch (_) {
    return;
  }
  const body = el("div", { class: "prompt" });
  body.appendChild(el("p", { class: "digest" }, "surface digest ", el("code", {}, p.surface_digest || "—")));
  for (const l of p.layers || []) {
    const stable = p.stable_prefix && l.text && p.stable_prefix.includes(l.text);
    body.appendChild(el("section", { class: "layer", "data-layer": l.label },
      el("h3", {}, l.label),
      el("div", { class: "layer-kind" }, (l.kind || "") + (stable ? " · stable prefix" : "")),
      el("pre", {}, l.text || "")));
  }
  openDrawer("prompt", "System prompt", body);
});

async function showTree() {
  const v = S.open;
  const root = S.trail[0] || (v && v.id);
  if (!root) return;
  let tree;
  let metrics;
  try {
    [tree, metrics] = await Promise.all([
      call("harness::session-tree", { session_id: root }),
      call("harness::metrics", { root_session_id: root }, { quiet: true }).catch(() => null),
    ]);
  } catch (_) {
    return;
  }
  const cost = new Map(((metrics && metrics.by_session) || []).map((/** @type {any} */ s) => [s.session_id, s.cost_usd]));
  const metaOf = new Map(S.sessions.map((s) => [s.session_id, s]));
  /** @param {any} n */
  const node = (n) => {
    const meta = metaOf.get(n.session_id);
    const display = meta && meta.metadata && meta.metadata.agent && meta.metadata.agent.display;
    const name = (display && (display.name || display.title)) || n.title || n.session_id;
    const icon = (display && display.icon) || "";
    const status = n.turn_status || "idle";
    const item = el("li", { "data-tree-session": n.session_id },
      el("button", { type: "button", class: "link-button tree-node", onclick: () => {
        if (n.session_id === root) openSession(root);
        else {
          S.trail = [root];
          openSession(n.session_id, { readOnly: true });
          renderBreadcrumb();
        }
      } }, (icon ? icon + " " : "") + name),
      el("span", { class: "tree-meta" }, ` ${statusIcon(status)} ${status} · depth ${n.depth} · ${usd(/** @type {number} */ (cost.get(n.session_id)))}`));
    if (display && display.color) item.dataset.color = display.color;
    if (n.children && n.children.length) item.appendChild(el("ul", {}, n.children.map(node)));
    return item;
  };
  openDrawer("tree", "Sub-agents", el("ul", { class: "tree" }, node(tree)));
}

$("tree-open").addEventListener("click", showTree);

/** @param {string} turnId */
function showWaterfall(turnId) {
  const v = S.open;
  if (!v) return;
  const bar = buildTurn(v.events, v.entries, turnId, v.childOf);
  if (!bar) return;
  const draw = () => openDrawer("waterfall", "Waterfall of turn " + turnId.slice(-8), renderWaterfall(bar, openChild, expand));
  /** Loads a spawned child's stored events (its own stream, closed once its turns are all read). @param {any} spawn */
  const expand = (spawn) => {
    /** @type {any[]} */
    const events = [];
    const entries = new Map();
    let quiet = 0;
    const stream = openStream(spawn.child, {
      onEvent: (ev) => {
        events.push(ev);
        if (ev.entry) entries.set(ev.entry.entry_id, ev.entry);
        clearTimeout(quiet);
        // The stream has no end: once every started turn has completed and nothing more
        // arrives for a moment, the stored history has been read.
        const started = events.filter((e) => e.topic === "harness::turn-started").length;
        const done = events.filter((e) => e.topic === "harness::turn-completed").length;
        if (started > 0 && started === done) {
          quiet = window.setTimeout(() => {
            stream.close();
            nestChild(spawn, events, entries);
            draw();
          }, 200);
        }
      },
      onState: () => {},
    });
  };
  draw();
}

// --- start ----------------------------------------------------------------------------------

let started = false;
async function start() {
  try {
    await loadCatalog();
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) return; // the token form is up
    return;
  }
  if (!started) {
    started = true;
    scheduleList();
  }
  await refreshList();
  const m = /^#session=(.+)$/.exec(location.hash);
  if (m) openSession(decodeURIComponent(m[1]));
  else newChat();
}

adoptFragmentToken();
start();
