// The API client: every call is POST /v1/functions/{id} with the token (when one is set).
// The token comes from the URL fragment (#token=..., never sent to the server), lives in
// sessionStorage for this tab, and is removed from the address bar at once.

const TOKEN_KEY = "harness.token";

/** @typedef {{status: number, code: string, message: string}} ApiFailure */

export class ApiError extends Error {
  /** @param {number} status @param {string} code @param {string} message */
  constructor(status, code, message) {
    super(`${code}: ${message}`);
    this.status = status;
    this.code = code;
    this.apiMessage = message;
  }
}

/** Moves a `#token=` fragment into sessionStorage and cleans the address bar. */
export function adoptFragmentToken() {
  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  const t = params.get("token");
  if (t === null) return;
  if (t.trim() !== "") sessionStorage.setItem(TOKEN_KEY, t.trim());
  params.delete("token");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

/** @param {string} t */
export function setToken(t) {
  sessionStorage.setItem(TOKEN_KEY, t);
}

/** @returns {Record<string, string>} */
export function authHeaders() {
  const t = token();
  return t ? { Authorization: "Bearer " + t } : {};
}

/** Called with every failure; the app shows it (never a silent failure). */
let onFailure = (/** @type {ApiError} */ _e) => {};
/** @param {(e: ApiError) => void} f */
export function setFailureHandler(f) {
  onFailure = f;
}

/**
 * Calls a bus function. Resolves with the JSON answer, rejects with an ApiError (reported to
 * the failure handler unless `quiet`).
 * @param {string} fn @param {any} payload @param {{quiet?: boolean}} [opts]
 */
export async function call(fn, payload = {}, opts = {}) {
  let resp;
  try {
    resp = await fetch("/v1/functions/" + encodeURIComponent(fn).replace(/%3A/g, ":"), {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(payload),
    });
  } catch (e) {
    const err = new ApiError(0, "harness/unreachable", `${fn}: the server did not answer (${e})`);
    if (!opts.quiet) onFailure(err);
    throw err;
  }
  let body = null;
  try {
    body = await resp.json();
  } catch (_) {
    body = null;
  }
  if (resp.ok) return body;
  const code = (body && body.error && body.error.code) || "harness/http_" + resp.status;
  const message = (body && body.error && body.error.message) || resp.statusText;
  const err = new ApiError(resp.status, code, message);
  if (!opts.quiet || resp.status === 401) onFailure(err);
  throw err;
}
