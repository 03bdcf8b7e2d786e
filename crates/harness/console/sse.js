// The session event stream over fetch() (EventSource cannot send Authorization): a streaming
// text/event-stream parser, reconnect with Last-Event-ID and backoff 0.5 s doubling to 8 s, and
// the highest id seen per stream, so no event is delivered twice.

import { authHeaders } from "./api.js";

/**
 * @typedef {{id: number, topic: string, at_ms: number, payload: any, entry?: any}} HarnessEvent
 * @typedef {{state: "connecting"|"live"|"reconnecting"|"gone"|"too_many"|"unauthorized"|"missing", attempt?: number, message?: string}} StreamState
 */

/**
 * Splits a growing text buffer into complete SSE events; returns the events and the rest.
 * @param {string} buf
 * @returns {{events: {id: string|null, event: string|null, data: string}[], rest: string}}
 */
export function parseEvents(buf) {
  const events = [];
  buf = buf.replace(/\r\n?/g, "\n");
  let cut;
  while ((cut = buf.indexOf("\n\n")) >= 0) {
    const block = buf.slice(0, cut);
    buf = buf.slice(cut + 2);
    let id = null;
    let event = null;
    const data = [];
    for (const line of block.split("\n")) {
      if (line === "" || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "id") id = value;
      else if (field === "event") event = value;
      else if (field === "data") data.push(value);
    }
    if (data.length) events.push({ id, event, data: data.join("\n") });
  }
  return { events, rest: buf };
}

/**
 * The `error.message` of a JSON error answer, or `fallback` when the body is not one.
 * @param {Response} resp
 * @param {string} fallback
 * @returns {Promise<string>}
 */
async function errorMessage(resp, fallback) {
  try {
    return (await resp.json()).error.message;
  } catch (_) {
    return fallback;
  }
}

/**
 * Opens a session's stream. `onEvent` gets each event once, in id order.
 * @param {string} sessionId
 * @param {{after?: number, onEvent: (e: HarnessEvent) => void, onState: (s: StreamState) => void}} opts
 */
export function openStream(sessionId, opts) {
  let last = opts.after || 0;
  let closed = false;
  let controller = null;
  let attempt = 0;
  let timer = null;

  const schedule = (/** @type {number} */ ms) => {
    if (closed) return;
    timer = setTimeout(run, ms);
  };

  async function run() {
    if (closed) return;
    controller = new AbortController();
    opts.onState({ state: attempt === 0 ? "connecting" : "reconnecting", attempt });
    let resp;
    try {
      resp = await fetch(`/v1/sessions/${encodeURIComponent(sessionId)}/events`, {
        headers: { Accept: "text/event-stream", "Last-Event-ID": String(last), ...authHeaders() },
        signal: controller.signal,
        cache: "no-store",
      });
    } catch (_) {
      return retry();
    }
    if (resp.status === 401) {
      opts.onState({ state: "unauthorized" });
      return;
    }
    if (resp.status === 404) {
      const message = await errorMessage(resp, "no such session");
      opts.onState({ state: "missing", message });
      return;
    }
    if (resp.status === 429) {
      const message = await errorMessage(resp, "too many open event streams");
      opts.onState({ state: "too_many", message });
      return schedule(5000);
    }
    if (!resp.ok || !resp.body) return retry();
    attempt = 0;
    opts.onState({ state: "live" });
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        const parsed = parseEvents(buf);
        buf = parsed.rest;
        for (const raw of parsed.events) {
          let data;
          try {
            data = JSON.parse(raw.data);
          } catch (_) {
            continue;
          }
          const id = Number(raw.id ?? data.id);
          if (!(id > last)) continue; // already delivered
          last = id;
          opts.onEvent(data);
        }
      }
    } catch (_) {
      // aborted or the connection broke: fall through to the retry
    }
    retry();
  }

  function retry() {
    if (closed) return;
    attempt += 1;
    const delay = Math.min(8000, 500 * 2 ** (attempt - 1));
    opts.onState({ state: attempt > 6 ? "gone" : "reconnecting", attempt });
    schedule(delay);
  }

  run();
  return {
    close() {
      closed = true;
      if (timer) clearTimeout(timer);
      if (controller) controller.abort();
    },
    lastId: () => last,
  };
}
