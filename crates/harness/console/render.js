// DOM building. Every text a model, a tool or a user wrote goes through text nodes
// (textContent / createTextNode): nothing here parses HTML.

/**
 * `el("div", {class: "x", onclick: f}, "text", child)`.
 * @param {string} tag @param {Record<string, any>} [attrs] @param {...any} children
 * @returns {HTMLElement}
 */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
    else if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k === "text") node.textContent = String(v);
    else if (v === true) node.setAttribute(k, "");
    else node.setAttribute(k, String(v));
  }
  append(node, children);
  return node;
}

/** @param {Node} node @param {any[]} children */
function append(node, children) {
  for (const c of children) {
    if (c === undefined || c === null || c === false) continue;
    if (Array.isArray(c)) append(node, c);
    else if (c instanceof Node) node.appendChild(c);
    else node.appendChild(document.createTextNode(String(c)));
  }
}

/** @param {Node} node */
export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

/** Pretty JSON as text. @param {any} v */
export function json(v) {
  try {
    return JSON.stringify(v, null, 2);
  } catch (_) {
    return String(v);
  }
}

/** @param {number|undefined|null} usd */
export function usd(usd) {
  if (usd === undefined || usd === null) return "$—";
  if (usd === 0) return "$0";
  return usd < 0.01 ? "$" + usd.toFixed(6) : "$" + usd.toFixed(4);
}

/** @param {number} ms */
export function ago(ms) {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return s + " s ago";
  if (s < 3600) return Math.round(s / 60) + " min ago";
  if (s < 86400) return Math.round(s / 3600) + " h ago";
  return new Date(ms).toLocaleDateString();
}

/**
 * A markdown subset as DOM: paragraphs, bullet and numbered lists, fenced code blocks, inline
 * code, *emphasis* / **strong**, and [links](url) shown as "text (url)" (never a live href).
 * @param {string} text
 * @returns {DocumentFragment}
 */
export function markdown(text) {
  const frag = document.createDocumentFragment();
  const lines = String(text).split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (line.startsWith("```")) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].startsWith("```")) body.push(lines[i++]);
      i++;
      frag.appendChild(el("pre", { class: "code" }, el("code", {}, body.join("\n"))));
      continue;
    }
    const bullet = /^\s*[-*]\s+(.*)$/;
    const numbered = /^\s*\d+[.)]\s+(.*)$/;
    if (bullet.test(line) || numbered.test(line)) {
      const re = bullet.test(line) ? bullet : numbered;
      const list = el(re === bullet ? "ul" : "ol");
      while (i < lines.length && re.test(lines[i])) {
        const m = re.exec(lines[i]);
        list.appendChild(el("li", {}, inline(m ? m[1] : "")));
        i++;
      }
      frag.appendChild(list);
      continue;
    }
    if (line.trim() === "") {
      i++;
      continue;
    }
    const para = [];
    while (
      i < lines.length &&
      lines[i].trim() !== "" &&
      !lines[i].startsWith("```") &&
      !bullet.test(lines[i]) &&
      !numbered.test(lines[i])
    )
      para.push(lines[i++]);
    const p = el("p");
    para.forEach((l, k) => {
      if (k) p.appendChild(el("br"));
      p.appendChild(inline(l));
    });
    frag.appendChild(p);
  }
  return frag;
}

/** @param {string} s @returns {DocumentFragment} */
function inline(s) {
  const frag = document.createDocumentFragment();
  const re = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*)|(\[[^\]]*\]\([^)\s]*\))/g;
  let at = 0;
  let m;
  while ((m = re.exec(s))) {
    if (m.index > at) frag.appendChild(document.createTextNode(s.slice(at, m.index)));
    const t = m[0];
    if (m[1]) frag.appendChild(el("code", {}, t.slice(1, -1)));
    else if (m[2]) frag.appendChild(el("strong", {}, t.slice(2, -2)));
    else if (m[3]) frag.appendChild(el("em", {}, t.slice(1, -1)));
    else {
      const close = t.indexOf("](");
      frag.appendChild(
        el("span", { class: "link" }, t.slice(1, close), " (", el("span", { class: "url" }, t.slice(close + 2, -1)), ")"),
      );
    }
    at = m.index + t.length;
  }
  if (at < s.length) frag.appendChild(document.createTextNode(s.slice(at)));
  return frag;
}

/** A collapsed JSON block that expands on click. @param {string} label @param {any} value */
export function jsonBlock(label, value) {
  return el("details", { class: "json" }, el("summary", {}, label), el("pre", {}, json(value)));
}
