// The trajectory viewer: a segment's tokens, sampled ones coloured by their behaviour logprob,
// loss-masked context (prompt) in grey, tool messages in blue, a side request's reply struck
// through (recorded, never trained), and a badge with the policy version wherever the version of
// the sampled tokens changes.
"use strict";

// Probability -> colour: red (unlikely) through yellow to green (certain).
function logprobColour(lp) {
  const p = Math.exp(Math.max(lp, -20));
  const hue = Math.round(120 * p);
  return `hsl(${hue}, 75%, ${88 - 18 * p}%)`;
}

// Token indexes inside tool messages (ChatML `<|im_start|>tool ... <|im_end|>`) or
// `<tool_response>` blocks: context the agent's tools produced, not the model.
function toolTokens(texts) {
  const starts = [];
  let full = "";
  for (const t of texts) { starts.push(full.length); full += t; }
  const ranges = [];
  const re = /<\|im_start\|>tool[\s\S]*?(?:<\|im_end\|>|$)|<tool_response>[\s\S]*?(?:<\/tool_response>|$)/g;
  let m;
  while ((m = re.exec(full)) !== null) {
    ranges.push([m.index, m.index + m[0].length]);
    if (m[0].length === 0) re.lastIndex++;
  }
  const out = new Set();
  starts.forEach((s, i) => { if (ranges.some(([a, b]) => s >= a && s < b)) out.add(i); });
  return out;
}

function renderSegment(seg) {
  const box = document.createElement("div");
  box.className = "segment";
  box.dataset.testid = "segment";
  const texts = seg.texts || seg.tokens.map((t) => `[${t}]`);
  const tools = toolTokens(texts);
  const side = new Map();  // token index -> the side request rule that marked its turn
  (seg.turn_side || []).forEach((rule, t) => {
    if (!rule) return;
    const [a, b] = seg.turn_spans[t];
    for (let i = a; i < b; i++) side.set(i, rule);
  });
  let lastVersion = null;
  seg.tokens.forEach((id, i) => {
    const sampled = seg.loss_mask[i] === 1;
    const version = seg.versions[i];
    if (sampled && version !== lastVersion) {
      const badge = document.createElement("span");
      badge.className = "ver";
      badge.dataset.testid = "version-badge";
      badge.textContent = "v" + version;
      box.appendChild(badge);
      lastVersion = version;
    }
    if (!sampled) lastVersion = null;
    const span = document.createElement("span");
    span.className = "tok " + (sampled ? "sampled" : tools.has(i) ? "tool" : "masked") + (side.has(i) ? " side" : "");
    span.textContent = texts[i];
    span.dataset.i = String(i);
    if (sampled) {
      span.style.background = logprobColour(seg.logprobs[i]);
      span.title = `#${i} id ${id} | logprob ${seg.logprobs[i].toFixed(4)} | version ${version}` +
        (side.has(i) ? ` | side request (${side.get(i)}): not trained` : "");
    } else {
      span.title = `#${i} id ${id} | ${tools.has(i) ? "tool output" : "context"} (loss-masked)`;
    }
    box.appendChild(span);
  });
  return box;
}
