// A small, safe markdown renderer for model output.
//
// Invariant: every character of the input reaches the output HTML-escaped; the only markup in the result is
// what this module writes itself (headings, paragraphs, lists, emphasis, code, links). Link targets must be
// http(s) URLs (anything else stays plain text), so the result is safe to assign to innerHTML.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// Placeholders for inline code spans while emphasis and links are rewritten; NUL never survives escaping input.
const HOLE = "\u0000";

function inline(raw) {
  const codes = [];
  let s = escapeHtml(raw).replace(/`([^`]+)`/g, (_, code) => {
    codes.push(`<code>${code}</code>`);
    return `${HOLE}${codes.length - 1}${HOLE}`;
  });
  s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)\u0000]+)\)/g,
    (_, label, url) => `<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
  s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/__([^_]+)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^\w_])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>");
  return s.replace(new RegExp(`${HOLE}(\\d+)${HOLE}`, "g"), (_, i) => codes[Number(i)]);
}

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;

// Markdown text -> HTML string. An unclosed fence (a reply still streaming) runs to the end of the text.
export function renderMarkdown(text) {
  const lines = text.replace(/\u0000/g, "").replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let para = [];
  let list = null;  // {tag, items}

  const flushPara = () => {
    if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
    para = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`);
    list = null;
  };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flushPara(); flushList();
      const body = [];
      for (i++; i < lines.length && !(lines[i].trim().startsWith(fence[1]) && lines[i].trim() === fence[1]); i++) {
        body.push(lines[i]);
      }
      const lang = fence[2] ? ` class="language-${escapeHtml(fence[2])}"` : "";
      out.push(`<pre><code${lang}>${escapeHtml(body.join("\n"))}</code></pre>`);
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      flushPara(); flushList();
      const n = heading[1].length;
      out.push(`<h${n}>${inline(heading[2])}</h${n}>`);
      continue;
    }
    const bullet = BULLET.exec(line);
    const numbered = bullet ? null : NUMBERED.exec(line);
    if (bullet || numbered) {
      flushPara();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push((bullet || numbered)[1]);
      continue;
    }
    if (line.trim() === "") {
      flushPara(); flushList();
      continue;
    }
    flushList();
    para.push(line);
  }
  flushPara(); flushList();
  return out.join("\n");
}
