// Line charts as inline SVG (no library): one series per chart, nulls skipped.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  return el;
}

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return String(Math.round(v * 1000) / 1000);
}

// A chart card: `title`, x values `xs` (steps) and y values `ys` (numbers or null).
function lineChart(title, xs, ys, testid) {
  const card = document.createElement("div");
  card.className = "chart";
  if (testid) card.dataset.testid = testid;
  const h = document.createElement("h3");
  const points = xs.map((x, i) => [x, ys[i]]).filter(([, y]) => y !== null && isFinite(y));
  const last = points.length ? points[points.length - 1][1] : null;
  h.textContent = title + (last === null ? "" : "  (last " + fmt(last) + ")");
  card.appendChild(h);
  const W = 300, H = 120, L = 44, R = 6, T = 8, B = 18;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  card.appendChild(svg);
  if (!points.length) {
    const t = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" });
    t.textContent = "no steps yet";
    svg.appendChild(t);
    return card;
  }
  const xsN = points.map((p) => p[0]), ysN = points.map((p) => p[1]);
  let x0 = Math.min(...xsN), x1 = Math.max(...xsN), y0 = Math.min(...ysN), y1 = Math.max(...ysN);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  svg.appendChild(svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ccd" }));
  svg.appendChild(svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#ccd" }));
  for (const [y, v] of [[T + 8, y1], [H - B, y0]]) {
    const t = svgEl("text", { x: L - 4, y, "text-anchor": "end", "font-size": 9, fill: "#6b7385" });
    t.textContent = fmt(v);
    svg.appendChild(t);
  }
  for (const [x, v, anchor] of [[L, x0, "start"], [W - R, x1, "end"]]) {
    const t = svgEl("text", { x, y: H - 4, "text-anchor": anchor, "font-size": 9, fill: "#6b7385" });
    t.textContent = "step " + fmt(v);
    svg.appendChild(t);
  }
  const d = points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
  svg.appendChild(svgEl("polyline", { points: d, fill: "none", stroke: "#3458d6", "stroke-width": 1.5 }));
  for (const [x, y] of points.length <= 60 ? points : []) {
    svg.appendChild(svgEl("circle", { cx: sx(x), cy: sy(y), r: 2, fill: "#3458d6" }));
  }
  return card;
}
