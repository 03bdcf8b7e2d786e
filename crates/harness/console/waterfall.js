// The turn waterfall, built from the durable events alone (so it is the same after a reload or
// a restart): the turn, each step's generation (its entry's first message-added to its last
// message-updated), each call under its step (end of that generation to its result's
// message-added) with the approval wait shaded, and the rest of the step as "loop". The rows
// have the shape of the OpenTelemetry trace (turn → step → chat / execute_tool / invoke_agent).

import { el, usd } from "./render.js";

/**
 * @typedef {{kind: string, label: string, start: number, end: number, depth: number, error?: string,
 *   wait?: [number, number], critical?: boolean, children: Bar[], usage?: string, child?: string}} Bar
 */

/**
 * @param {any[]} events every event of the session, in id order
 * @param {Map<string, any>} entries the transcript by entry_id
 * @param {string} turnId
 * @returns {Bar|null}
 */
export function buildTurn(events, entries, turnId, childOf = (/** @type {string} */ _id) => /** @type {string|undefined} */ (undefined)) {
  const started = events.find((e) => e.topic === "harness::turn-started" && e.payload.turn_id === turnId);
  if (!started) return null;
  const completed = events.find((e) => e.topic === "harness::turn-completed" && e.payload.turn_id === turnId);
  /** @type {Map<string, {added: number, updated: number}>} */
  const times = new Map();
  for (const e of events) {
    if (!e.topic.startsWith("session::message-") || !e.payload.entry_id) continue;
    const t = times.get(e.payload.entry_id) || { added: e.at_ms, updated: e.at_ms };
    if (e.topic === "session::message-added") t.added = Math.min(t.added, e.at_ms);
    t.updated = Math.max(t.updated, e.at_ms);
    times.set(e.payload.entry_id, t);
  }
  /** @type {Map<string, {requested?: number, decided?: number}>} */
  const waits = new Map();
  for (const e of events) {
    if (e.topic !== "approval::requested" && e.topic !== "approval::decided") continue;
    const w = waits.get(e.payload.function_call_id) || {};
    if (e.topic === "approval::requested") w.requested = w.requested ?? e.at_ms;
    else w.decided = e.at_ms;
    waits.set(e.payload.function_call_id, w);
  }
  const resultOf = new Map();
  for (const en of entries.values()) {
    if (en.message && en.message.role === "function_result") resultOf.set(en.message.function_call_id, en);
  }
  const gens = [...entries.values()]
    .filter((en) => en.message && en.message.role === "assistant" && en.origin && en.origin.turn_id === turnId)
    .sort((a, b) => a.seq - b.seq);
  const end = completed ? completed.at_ms : Math.max(started.at_ms, ...[...times.values()].map((t) => t.updated));
  /** @type {Bar} */
  const turn = {
    kind: "turn",
    label: "turn " + turnId.slice(-8) + (completed ? " · " + completed.payload.status : " · running"),
    start: started.at_ms,
    end,
    depth: 0,
    error: completed && completed.payload.status === "failed" ? completed.payload.result_error || "failed" : undefined,
    children: [],
  };
  gens.forEach((g, i) => {
    const t = times.get(g.entry_id);
    if (!t) return;
    const m = g.message;
    const u = m.usage || {};
    const usage = [m.model, "in " + (u.input ?? "?"), "out " + (u.output ?? "?"),
      u.cache_read ? "cache read " + u.cache_read : "", u.cache_write ? "cache write " + u.cache_write : "", usd(u.cost_usd)]
      .filter(Boolean).join(" · ");
    /** @type {Bar} */
    const gen = { kind: "chat", label: "generation " + (i + 1), start: t.added, end: t.updated, depth: 2, usage,
      error: m.error_kind ? m.error_kind + (m.error_message ? ": " + m.error_message : "") : undefined, children: [] };
    const step = { kind: "step", label: "step " + (i + 1), start: t.added, end: t.updated, depth: 1, children: [gen] };
    for (const b of m.content || []) {
      if (b.type !== "function_call") continue;
      const r = resultOf.get(b.id);
      const rt = r && times.get(r.entry_id);
      const w = waits.get(b.id);
      /** @type {Bar} */
      const call = {
        kind: b.function_id === "harness::spawn" ? "invoke_agent" : "execute_tool",
        label: b.function_id,
        start: t.updated,
        end: rt ? rt.added : end,
        depth: 2,
        error: r && r.message.is_error ? errorCode(r.message) : undefined,
        wait: w && w.requested !== undefined ? [w.requested, w.decided ?? (rt ? rt.added : end)] : undefined,
        child: (r && r.message.details && r.message.details.child_session_id) || (b.function_id === "harness::spawn" ? childOf(b.id) : undefined),
        children: [],
      };
      step.children.push(call);
    }
    step.end = Math.max(...step.children.map((c) => c.end));
    turn.children.push(step);
  });
  // The loop: what each step spends outside its generation and calls, up to the next step.
  turn.children.forEach((step, i) => {
    const next = i + 1 < turn.children.length ? turn.children[i + 1].start : turn.end;
    if (next > step.end) step.children.push({ kind: "loop", label: "loop", start: step.end, end: next, depth: 2, children: [] });
    step.end = Math.max(step.end, next);
  });
  markCritical(turn);
  return turn;
}

/** @param {any} m */
function errorCode(m) {
  const d = m.details || {};
  const text = (m.content || []).filter((b) => b.type === "text").map((b) => b.text).join(" ");
  return String(d.code || d.error || text.slice(0, 80) || "error");
}

/** The longest child at each level, as the iii console marks it. @param {Bar} bar */
function markCritical(bar) {
  bar.critical = true;
  if (!bar.children.length) return;
  let best = bar.children[0];
  for (const c of bar.children) if (c.end - c.start > best.end - best.start) best = c;
  markCritical(best);
}

/** @param {Bar} root @returns {Bar[]} */
function flatten(root) {
  const out = [root];
  for (const c of root.children) out.push(...flatten(c));
  return out;
}

/**
 * The panel: one row per bar, positioned on the turn's time axis; "errors only" hides the rest.
 * @param {Bar} root @param {(child: string) => void} onChild
 */
export function renderWaterfall(root, onChild, onExpand = (/** @type {Bar} */ _b) => {}) {
  const span = Math.max(1, root.end - root.start);
  const rows = el("div", { class: "wf-rows" });
  for (const b of flatten(root)) {
    const dur = b.end - b.start;
    const left = ((b.start - root.start) / span) * 100;
    const width = Math.max(0.5, (dur / span) * 100);
    const bar = el("div", {
      class: "wf-bar wf-" + b.kind + (b.error ? " wf-error" : "") + (b.critical ? " wf-critical" : ""),
      style: null,
    });
    bar.style.left = left + "%";
    bar.style.width = width + "%";
    if (b.wait) {
      const w = el("div", { class: "wf-wait", title: "approval wait" });
      w.style.left = (((b.wait[0] - b.start) / Math.max(1, dur)) * 100) + "%";
      w.style.width = (((b.wait[1] - b.wait[0]) / Math.max(1, dur)) * 100) + "%";
      bar.appendChild(w);
    }
    const row = el("div", {
      class: "wf-row" + (b.error ? " wf-row-error" : ""),
      "data-kind": b.kind,
      "data-duration": dur,
      "data-error": b.error ? "1" : null,
    },
      el("div", { class: "wf-label" }, "\u00a0".repeat(b.depth * 2) + b.label,
        b.critical ? el("span", { class: "wf-crit", title: "critical path" }, " ★") : null,
        b.error ? el("span", { class: "wf-err" }, " ✖ " + b.error) : null),
      el("div", { class: "wf-track" }, bar),
      el("div", { class: "wf-dur" }, dur + " ms"),
      b.usage ? el("div", { class: "wf-usage" }, b.usage) : null,
      b.child ? el("button", { type: "button", class: "link-button", onclick: () => onChild(b.child || "") }, "open sub-agent") : null,
      b.child && !b.children.length ? el("button", { type: "button", class: "link-button wf-expand", onclick: () => onExpand(b) }, "show its turns") : null,
    );
    rows.appendChild(row);
  }
  const toggle = el("input", { type: "checkbox", id: "wf-errors-only" });
  toggle.addEventListener("change", () => rows.classList.toggle("errors-only", toggle.checked));
  return el("section", { class: "waterfall", "aria-label": "Turn waterfall" },
    el("label", { class: "check" }, toggle, " errors only"),
    el("p", { class: "note" }, "★ critical path (the longest bar at each level); shaded: waiting for an approval"),
    rows);
}

/**
 * Nests a child session's turns under a spawn bar (their bars one level deeper).
 * @param {Bar} spawn @param {any[]} events the child's events @param {Map<string, any>} entries
 */
export function nestChild(spawn, events, entries) {
  const turns = events.filter((e) => e.topic === "harness::turn-started").map((e) => e.payload.turn_id);
  for (const t of turns) {
    const bar = buildTurn(events, entries, t);
    if (!bar) continue;
    const shift = (/** @type {Bar} */ b, /** @type {number} */ d) => {
      b.depth += d;
      b.children.forEach((c) => shift(c, d));
    };
    shift(bar, spawn.depth + 1);
    bar.label = "sub-agent " + bar.label;
    spawn.children.push(bar);
  }
}
