// The transcript: entries keyed by entry_id and rebuilt only when their revision (or what is
// shown inside them: a call's result, its approval, an ask card's liveness) changes. Function
// results render inside the call block that asked for them.

import { el, clear, markdown, jsonBlock, json, usd } from "./render.js";

/** How many of the newest entries are rendered; older ones load on demand. */
export const PAGE = 200;

/**
 * @typedef {{entry_id: string, seq: number, revision: number, message?: any, custom?: any, origin?: any}} Entry
 * @typedef {{
 *   entries: Map<string, Entry>,
 *   results: Map<string, Entry>,
 *   approvals: Map<string, any>,
 *   latestTurn: string|null,
 *   turnStatus: Map<string, string>,
 *   shown: number,
 *   readOnly: boolean,
 *   askState: Map<string, any>,
 *   onApprove: (a: any, decision: string, reason: string) => void,
 *   onAnswer: (text: string) => void,
 *   onOpenChild: (sessionId: string) => void,
 *   onWaterfall: (turnId: string) => void,
 *   childOf: (callId: string) => string|undefined,
 *   times: Map<string, {added: number, updated: number}>,
 * }} View
 */

/** @param {any} m */
export function textOf(m) {
  if (!m || !Array.isArray(m.content)) return "";
  return m.content.filter((b) => b.type === "text").map((b) => b.text).join("");
}

/** Content blocks as readable text (a result's content). @param {any[]} blocks */
function blocksText(blocks) {
  return (blocks || [])
    .map((b) => (b.type === "text" ? b.text : b.type === "image" ? "[image " + b.mime + "]" : json(b)))
    .join("\n");
}

/** @param {any} u */
export function usageLine(m) {
  const u = m.usage || {};
  const parts = [m.model, m.provider];
  if (u.input !== undefined) parts.push("in " + u.input);
  if (u.output !== undefined) parts.push("out " + u.output);
  if (u.cache_read) parts.push("cache read " + u.cache_read);
  if (u.cache_write) parts.push("cache write " + u.cache_write);
  if (u.reasoning) parts.push("reasoning " + u.reasoning);
  parts.push(usd(u.cost_usd));
  if (u.estimated) parts.push("estimated");
  return parts.filter((p) => p !== undefined && p !== null && p !== "").join(" · ");
}

/** What a result is, as a label: ok, error, denied, interrupted, cancelled. @param {any} r */
export function resultKind(r) {
  const d = r.details || {};
  if (d.error === "approval_denied") return "denied";
  if (d.status === "awaiting_answer") return "asked";
  const text = blocksText(r.content).toLowerCase();
  if (d.cancelled || d.error === "cancelled" || (r.is_error && /cancel/.test(text))) return "cancelled";
  if (d.interrupted || d.error === "interrupted" || (r.is_error && /interrupt/.test(text))) return "interrupted";
  return r.is_error ? "error" : "ok";
}

/**
 * A node's key: it is rebuilt when this changes.
 * @param {View} v @param {Entry} e
 */
function keyOf(v, e) {
  let k = String(e.revision);
  const m = e.message;
  if (m && m.role === "assistant") {
    for (const b of m.content || []) {
      if (b.type !== "function_call") continue;
      const r = v.results.get(b.id);
      const a = v.approvals.get(b.id);
      k += "|" + (r ? r.revision + ":" + askLive(v, r) : "-") + (a ? ":" + a.status : "");
      if (b.function_id === "harness::spawn") k += ":" + (v.childOf(b.id) || "");
    }
  }
  return k + (v.readOnly ? "|ro" : "");
}

/** @param {View} v @param {Entry} r */
function askLive(v, r) {
  const d = r.message && r.message.details;
  return !!(d && d.status === "awaiting_answer" && d.turn_id === v.latestTurn && !v.readOnly &&
    v.turnStatus.get(d.turn_id) !== "answered");
}

/**
 * Renders the newest `v.shown` entries into `root`, reusing nodes whose key is unchanged.
 * @param {HTMLElement} root @param {View} v @param {Map<string, {key: string, node: HTMLElement}>} cache
 */
export function renderTranscript(root, v, cache) {
  const all = [...v.entries.values()]
    .filter((e) => !(e.message && e.message.role === "function_result" && callShown(v, e)))
    .sort((a, b) => a.seq - b.seq);
  const visible = all.slice(Math.max(0, all.length - v.shown));
  const want = [];
  if (all.length > visible.length) {
    want.push(cached(cache, "__older", String(all.length - visible.length), () =>
      el("button", { type: "button", class: "older", "data-older": "1" }, `Show ${Math.min(PAGE, all.length - visible.length)} older entries`),
    ));
  }
  let turn = null;
  for (const e of visible) {
    const t = e.origin && e.origin.turn_id;
    if (t && t !== turn) {
      turn = t;
      want.push(cached(cache, "__turn_" + t, (v.turnStatus.get(t) || "") + turnCost(v, t), () => turnHeader(v, t)));
    }
    want.push(cached(cache, e.entry_id, keyOf(v, e), () => entryNode(v, e)));
  }
  // Reorder / insert / remove with the fewest DOM moves.
  let at = root.firstChild;
  for (const node of want) {
    if (node === at) {
      at = at.nextSibling;
      continue;
    }
    root.insertBefore(node, at);
  }
  while (at) {
    const next = at.nextSibling;
    root.removeChild(at);
    at = next;
  }
}

/** @param {View} v @param {Entry} r */
function callShown(v, r) {
  const id = r.message.function_call_id;
  for (const e of v.entries.values()) {
    const m = e.message;
    if (m && m.role === "assistant" && (m.content || []).some((b) => b.type === "function_call" && b.id === id)) return true;
  }
  return false;
}

/** @param {Map<string, {key: string, node: HTMLElement}>} cache @param {string} id @param {string} key @param {() => HTMLElement} make */
function cached(cache, id, key, make) {
  const hit = cache.get(id);
  if (hit && hit.key === key) return hit.node;
  const node = make();
  cache.set(id, { key, node });
  return node;
}

/** @param {View} v @param {string} t */
function turnCost(v, t) {
  let sum = 0;
  let any = false;
  for (const e of v.entries.values()) {
    const m = e.message;
    if (m && m.role === "assistant" && e.origin && e.origin.turn_id === t && m.usage && m.usage.cost_usd !== undefined) {
      sum += m.usage.cost_usd;
      any = true;
    }
  }
  return any ? usd(sum) : "";
}

/** @param {View} v @param {string} t */
function turnHeader(v, t) {
  const status = v.turnStatus.get(t) || "running";
  const cost = turnCost(v, t);
  return el("div", { class: "turn-head", "data-turn": t },
    el("span", { class: "turn-id" }, "Turn " + t.slice(-8)),
    el("span", { class: "turn-status status-" + status }, statusIcon(status) + " " + status),
    cost ? el("span", { class: "turn-cost", "data-turn-cost": t }, "turn " + cost) : null,
    el("button", { type: "button", class: "link-button", "aria-label": "Waterfall of turn " + t.slice(-8), onclick: () => v.onWaterfall(t) }, "Waterfall"),
  );
}

/** Status as text and icon, never colour alone. @param {string} s */
export function statusIcon(s) {
  return { completed: "✔", done: "✔", idle: "○", working: "◐", running: "◐", failed: "✖", error: "✖", cancelled: "■", answered: "✔" }[s] || "•";
}

/** @param {View} v @param {Entry} e */
function entryNode(v, e) {
  const m = e.message;
  const node = el("article", { class: "entry", "data-entry": e.entry_id, "data-seq": e.seq });
  // An entry a model wrote through a call is that call's, never the model's reply or the
  // user's words: it says so before anything else.
  const w = e.origin && e.origin.written_by;
  if (w && w.function_call_id) {
    node.classList.add("written");
    node.appendChild(el("div", { class: "provenance" },
      `✎ written by call ${w.function_call_id}` + (w.function_id ? ` (${w.function_id})` : "")));
  }
  if (!m) {
    const c = e.custom || {};
    node.classList.add("custom");
    node.appendChild(el("div", { class: "who" }, "record " + (c.custom_type || "")));
    node.appendChild(jsonBlock("data", c.data));
    return node;
  }
  node.dataset.role = m.role;
  node.classList.add("role-" + m.role);
  if (m.role === "user") {
    node.appendChild(el("div", { class: "who" }, "You"));
    node.appendChild(el("div", { class: "text user-text" }, textOf(m)));
  } else if (m.role === "assistant") {
    node.appendChild(el("div", { class: "who" }, "Assistant"));
    for (const b of m.content || []) {
      if (b.type === "text") node.appendChild(el("div", { class: "text md" }, markdown(b.text)));
      else if (b.type === "thinking") node.appendChild(el("details", { class: "thinking" }, el("summary", {}, "thinking"), el("pre", {}, b.text)));
      else if (b.type === "function_call") node.appendChild(callBlock(v, b, e));
    }
    if (m.error_message) node.appendChild(el("div", { class: "entry-error" }, "✖ " + (m.error_kind || "error") + ": " + m.error_message));
    node.appendChild(el("div", { class: "usage", "data-usage": "1" }, usageLine(m)));
  } else if (m.role === "function_result") {
    node.appendChild(el("div", { class: "who" }, "Result of " + m.function_id));
    node.appendChild(resultBlock(v, m, e));
  } else {
    node.appendChild(el("div", { class: "who" }, m.custom_type || "notice"));
    node.appendChild(el("div", { class: "text" }, m.display || blocksText(m.content)));
  }
  return node;
}

/** @param {View} v @param {any} b @param {Entry} [owner] the assistant entry holding the call */
function callBlock(v, b, owner) {
  const r = v.results.get(b.id);
  const a = v.approvals.get(b.id);
  const node = el("div", { class: "call", "data-call": b.id, "data-function": b.function_id },
    el("div", { class: "call-head" }, el("span", { class: "fn" }, "⚙ " + b.function_id), el("span", { class: "call-id" }, b.id)),
    jsonBlock("arguments", b.arguments),
  );
  if (a && a.status === "pending" && !r) node.appendChild(approvalCard(v, a));
  if (r) {
    node.appendChild(resultBlock(v, r.message, r));
    // The call's duration: from the end of the generation that asked for it to its result.
    const asked = owner && v.times.get(owner.entry_id);
    const done = v.times.get(r.entry_id);
    if (asked && done) node.appendChild(el("div", { class: "note call-duration" }, `took ${Math.max(0, done.added - asked.updated)} ms`));
  }
  else if (!a) node.appendChild(el("div", { class: "call-wait" }, "… waiting for the result"));
  const child = b.function_id === "harness::spawn" && ((r && r.message.details && r.message.details.child_session_id) || v.childOf(b.id));
  if (child) {
    node.appendChild(el("button", { type: "button", class: "link-button", "data-child": child, onclick: () => v.onOpenChild(child) }, "Open sub-agent " + child));
  }
  return node;
}

/** @param {View} v @param {any} a */
function approvalCard(v, a) {
  const reason = el("input", { type: "text", class: "deny-reason", "aria-label": "Reason for denying " + a.function_id, placeholder: "reason (optional)" });
  const out = el("div", { class: "approval-error", role: "alert" });
  const card = el("div", { class: "approval-card", role: "group", "aria-label": "Approval for " + a.function_id, "data-approval": a.approval_id },
    el("div", { class: "approval-title" }, "⚠ Approval needed: " + a.function_id),
    el("pre", { class: "approval-args" }, json(a.arguments)),
    el("div", { class: "digest" }, "digest ", el("code", { class: "approval-digest" }, a.digest)),
    el("div", { class: "approval-actions" },
      el("button", { type: "button", class: "approve", "aria-label": "Approve " + a.function_id, onclick: () => v.onApprove(a, "approve", "") }, "Approve"),
      reason,
      el("button", { type: "button", class: "deny", "aria-label": "Deny " + a.function_id, onclick: () => v.onApprove(a, "deny", reason.value) }, "Deny"),
    ),
    out,
  );
  return card;
}

/** @param {View} v @param {any} m the function_result message @param {Entry} e */
function resultBlock(v, m, e) {
  const d = m.details;
  if (d && d.status === "awaiting_answer" && Array.isArray(d.questions)) return askCard(v, d, e);
  const kind = resultKind(m);
  const text = blocksText(m.content);
  const first = text.split("\n").slice(0, 12).join("\n");
  const node = el("div", { class: "result result-" + kind, "data-result": m.function_call_id },
    el("span", { class: "badge-kind kind-" + kind }, (kind === "ok" ? "✔ " : "✖ ") + kind),
    el("pre", { class: "result-text" }, first + (first.length < text.length ? "\n…" : "")),
  );
  if (d && typeof d === "object" && Object.keys(d).length) node.appendChild(jsonBlock("details", d));
  if (d && d.reconciliation) node.appendChild(el("div", { class: "note" }, "arguments repaired by reconciliation"));
  return node;
}

/** @param {View} v @param {any} d @param {Entry} e */
function askCard(v, d, e) {
  const live = askLive(v, e);
  const state = v.askState.get(d.question_id) || { picks: d.questions.map(() => new Set()), other: d.questions.map(() => "") };
  v.askState.set(d.question_id, state);
  const send = el("button", { type: "submit", class: "ask-send", disabled: true }, "Send answer");
  const complete = () => d.questions.every((_, i) => state.picks[i].size > 0 || state.other[i].trim() !== "");
  const refresh = () => {
    send.disabled = !live || !complete();
  };
  const form = el("form", { class: "ask-card" + (live ? "" : " answered"), "data-question": d.question_id });
  form.appendChild(el("div", { class: "ask-title" }, live ? "❓ The assistant asks" : "✔ answered"));
  d.questions.forEach((q, i) => {
    const fs = el("fieldset", { disabled: !live });
    fs.appendChild(el("legend", {}, q.header));
    fs.appendChild(el("p", { class: "ask-question" }, q.question));
    const name = d.question_id + "_" + i;
    q.options.forEach((o, j) => {
      const id = name + "_" + j;
      const input = el("input", { type: q.multi_select ? "checkbox" : "radio", name, id, value: o.label, checked: state.picks[i].has(o.label) });
      input.addEventListener("change", () => {
        if (!q.multi_select) state.picks[i].clear();
        if (input.checked) state.picks[i].add(o.label);
        else state.picks[i].delete(o.label);
        if (!q.multi_select && input.checked) {
          state.other[i] = "";
          otherInput.value = "";
        }
        refresh();
      });
      fs.appendChild(el("div", { class: "opt" }, input, el("label", { for: id }, o.label), o.description ? el("div", { class: "opt-desc" }, o.description) : null));
    });
    const otherId = name + "_other";
    const otherInput = el("input", { type: "text", id: otherId, value: state.other[i] });
    otherInput.addEventListener("input", () => {
      state.other[i] = otherInput.value;
      if (!q.multi_select && otherInput.value.trim() !== "") {
        state.picks[i].clear();
        fs.querySelectorAll("input[type=radio]").forEach((r) => ((/** @type {HTMLInputElement} */ (r)).checked = false));
      }
      refresh();
    });
    fs.appendChild(el("div", { class: "opt other" }, el("label", { for: otherId }, "Other"), otherInput));
    form.appendChild(fs);
  });
  form.appendChild(send);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (!live || !complete()) return;
    const lines = d.questions.map((q, i) => {
      const other = state.other[i].trim();
      const picked = q.options.map((o) => o.label).filter((l) => state.picks[i].has(l));
      if (other) picked.push(other);
      return q.header + ": " + picked.join(", ");
    });
    v.onAnswer(lines.join("\n"));
  });
  refresh();
  return form;
}
