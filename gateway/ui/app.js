// The page: runs list, run page (live charts, session browser, pause/resume/stop), session page
// (trajectory viewer, reward form). Hash routes: #/, #/runs/ID, #/sessions/ID.
// Every API call carries the admin token from sessionStorage; data is written with textContent,
// every id put into a path or a route goes through encodeURIComponent (`enc`), and no element gets
// an inline style attribute (the page's Content-Security-Policy allows only its own styles).
// The token comes from the login form, or from a fragment `#token=...` (a link `rlgateway serve`
// prints): fragments never reach the server, and the page drops it from the address at once.
"use strict";

const TOKEN_KEY = "rlgateway.adminToken";
let pollTimer = null;
// Each route() call takes the next number; a page whose route was overtaken (a click, a sign-in)
// while it waited for the API draws nothing and starts no poll.
let routeSeq = 0;
const overtaken = (seq) => seq !== routeSeq;

function token() { return sessionStorage.getItem(TOKEN_KEY); }
// One path segment: an id from the API or the address bar may hold "/", "?", "#" or "..".
const enc = encodeURIComponent;

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(method, path, body) {
  const sent = token();
  const headers = { Authorization: "Bearer " + sent };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await r.json().catch(() => ({}));
  // A refusal signs out only the token it refused: an answer to a request sent with an earlier
  // token (a wrong one, replaced by the right one meanwhile) leaves the new one alone.
  if (r.status === 401 && token() === sent) { sessionStorage.removeItem(TOKEN_KEY); showLogin("That token was refused."); }
  if (!r.ok) throw new ApiError(r.status, (data.error && data.error.message) || r.statusText);
  return data;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "testid") e.dataset.testid = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c === null || c === undefined ? "" : String(c)));
  return e;
}

function fmtNum(v) { return v === null || v === undefined ? "–" : (Math.round(v * 1000) / 1000).toString(); }
function fmtTime(s) { return s ? new Date(s).toLocaleString() : "–"; }
function statusBadge(s) { return el("span", { class: "status " + s, testid: "status" }, s); }
function view() { return document.getElementById("view"); }
// A legend entry coloured as a token of logprob `lp` (through the CSSOM, which the CSP allows).
function swatch(e, lp) { e.style.background = logprobColour(lp); return e; }

function showLogin(message) {
  document.getElementById("login").hidden = false;
  document.getElementById("logout").hidden = true;
  document.getElementById("login-error").textContent = message || "";
  view().replaceChildren();
}

function showError(err) {
  view().replaceChildren(el("p", { class: "error", testid: "error" }, String(err.message || err)));
}

// --- runs list --------------------------------------------------------------------------------

async function runsPage(seq) {
  const [data, eng] = await Promise.all([api("GET", "/runs"), api("GET", "/engines")]);
  if (overtaken(seq)) return;
  const engines = el("table", { testid: "engines" },
    el("tr", {}, ...["engine", "ok", "paused", "version", "running", "waiting"].map((h) => el("th", {}, h))),
    ...eng.engines.map((e) => el("tr", { testid: "engine-row" }, el("td", {}, e.name), el("td", {}, e.ok ? "yes" : "no"),
      el("td", {}, e.paused ? "yes" : "no"), el("td", { testid: "engine-version" }, e.version),
      el("td", {}, e.running), el("td", {}, e.waiting))));
  const rows = data.runs.map((r) =>
    el("tr", { class: "link", testid: "run-row", "data-run": r.id, onclick: () => (location.hash = "#/runs/" + enc(r.id)) },
      el("td", {}, r.name), el("td", { class: "mono" }, r.id), el("td", {}, statusBadge(r.status)),
      el("td", {}, r.sessions), el("td", {}, r.active_sessions), el("td", {}, r.rewarded_sessions),
      el("td", {}, r.consumed_sessions), el("td", {}, r.last_step === null ? "–" : r.last_step),
      el("td", {}, fmtTime(r.created_at))));
  view().replaceChildren(
    el("h1", {}, "Runs"),
    rows.length ? el("table", { testid: "runs" },
      el("tr", {}, ...["name", "id", "status", "sessions", "active", "rewarded", "trained", "step", "created"].map((h) => el("th", {}, h))),
      ...rows) : el("p", {}, "No runs yet: create one with POST /runs."),
    el("h2", {}, "Engines"), engines);
}

// --- run page ---------------------------------------------------------------------------------

const CHARTS = [
  ["reward_mean", "reward (mean)"], ["loss", "loss"], ["staleness_mean", "staleness (mean versions)"],
  ["tokens_per_s", "throughput (tokens/s)"], ["staleness_max", "staleness (max)"], ["step_seconds", "step time (s)"],
];

async function runPage(runId, seq) {
  const run = await api("GET", "/runs/" + enc(runId));
  if (overtaken(seq)) return;
  const charts = el("div", { class: "charts", testid: "charts" });
  const sessions = el("div", { testid: "sessions" });
  const filters = filterForm(runId, sessions);
  const controls = el("div", { class: "buttons" },
    ...["pause", "resume", "stop"].map((action) =>
      el("button", { testid: action, onclick: () => runAction(runId, action) }, action[0].toUpperCase() + action.slice(1))),
    el("button", { testid: "export", onclick: () => exportRun(runId).catch(showError) }, "Export JSONL"));
  view().replaceChildren(
    el("h1", {}, run.name, " ", statusBadge(run.status)),
    el("dl", { class: "kv" }, el("dt", {}, "id"), el("dd", { class: "mono", testid: "run-id" }, run.id),
      el("dt", {}, "config"), el("dd", { class: "mono" }, JSON.stringify(run.config)),
      el("dt", {}, "created"), el("dd", {}, fmtTime(run.created_at))),
    controls, el("p", { class: "error", id: "action-error" }),
    el("h2", {}, "Training"), outcomeTable(run.outcomes), charts, el("h2", {}, "Sessions"), filters, sessions);
  const refresh = async () => {
    const m = await api("GET", `/runs/${enc(runId)}/metrics`);
    charts.replaceChildren(...CHARTS.map(([key, title]) => lineChart(title, m.steps, m.series[key] || [], "chart-" + key)));
  };
  await Promise.all([refresh(), loadSessions(runId, sessions, filters, 0)]);
  if (overtaken(seq)) return;
  pollTimer = setInterval(() => refresh().catch(() => {}), 3000);
}

// What became of the run's sessions: every one the trainer took, or its agent failed, ends in one outcome.
function outcomeTable(outcomes) {
  const names = ["trained", "stale", "filtered", "untrainable", "incomplete", "orphaned", "failed", "pending"];
  return el("table", { testid: "outcomes" },
    el("tr", {}, ...names.map((n) => el("th", {}, n))),
    el("tr", {}, ...names.map((n) => el("td", { testid: "outcome-" + n }, (outcomes || {})[n] ?? 0))));
}

async function runAction(runId, action) {
  try {
    await api("POST", `/runs/${enc(runId)}/${action}`);
    await route();
  } catch (err) {
    document.getElementById("action-error").textContent = err.message;
  }
}

// The export needs the bearer header, so it is fetched and handed to the browser as a file.
async function exportRun(runId) {
  const r = await fetch(`/runs/${enc(runId)}/export`, { headers: { Authorization: "Bearer " + token() } });
  if (!r.ok) throw new ApiError(r.status, "export failed: " + r.statusText);
  const url = URL.createObjectURL(await r.blob());
  const a = el("a", { href: url, download: runId + ".jsonl" });
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function filterForm(runId, target) {
  const field = (name, label, input) => el("label", {}, label, input);
  const num = (name) => el("input", { name, type: "number", step: "any", testid: "filter-" + name });
  const status = el("select", { name: "status", testid: "filter-status" },
    el("option", { value: "" }, "any"), el("option", { value: "active" }, "active"), el("option", { value: "ended" }, "ended"));
  const form = el("form", { class: "filters", testid: "filters" },
    field("status", "status", status),
    field("min_reward", "min reward", num("min_reward")), field("max_reward", "max reward", num("max_reward")),
    field("min_version", "min version", num("min_version")), field("max_version", "max version", num("max_version")),
    field("min_prefix_breaks", "min prefix breaks", num("min_prefix_breaks")),
    el("button", { type: "submit", testid: "filter-apply" }, "Filter"));
  form.addEventListener("submit", (e) => { e.preventDefault(); loadSessions(runId, target, form, 0).catch(showError); });
  return form;
}

async function loadSessions(runId, target, form, offset) {
  const q = new URLSearchParams({ limit: "25", offset: String(offset) });
  for (const [k, v] of new FormData(form).entries()) if (v !== "") q.set(k, String(v));
  let data;
  try { data = await api("GET", `/runs/${enc(runId)}/sessions?${q}`); }
  catch (err) { target.replaceChildren(el("p", { class: "error" }, err.message)); return; }
  const rows = data.sessions.map((s) =>
    el("tr", { class: "link", testid: "session-row", "data-session": s.id, onclick: () => (location.hash = "#/sessions/" + enc(s.id)) },
      el("td", { class: "mono" }, s.id), el("td", {}, statusBadge(s.status)), el("td", {}, s.group_id || "–"),
      el("td", {}, s.turns), el("td", {}, fmtNum(s.reward)), el("td", {}, s.prefix_breaks),
      el("td", {}, s.outcome || s.train_state), el("td", {}, fmtTime(s.created_at))));
  const pager = el("div", { class: "pager" },
    `${data.total} sessions, showing ${data.total ? offset + 1 : 0}–${offset + data.sessions.length}`,
    offset > 0 ? el("button", { onclick: () => loadSessions(runId, target, form, Math.max(0, offset - 25)) }, "Newer") : "",
    data.next_offset !== null ? el("button", { onclick: () => loadSessions(runId, target, form, data.next_offset) }, "Older") : "");
  target.replaceChildren(pager, el("table", {},
    el("tr", {}, ...["id", "status", "group", "turns", "reward", "prefix breaks", "training", "created"].map((h) => el("th", {}, h))),
    ...rows));
}

// --- session page -----------------------------------------------------------------------------

async function sessionPage(sessionId, seq) {
  const s = await api("GET", `/sessions/${enc(sessionId)}?texts=true`);
  if (overtaken(seq)) return;
  const completions = s.segments.flatMap((g) => g.completion_ids);
  const rewards = el("table", { testid: "rewards" },
    el("tr", {}, ...["reward", "turn", "key", "at"].map((h) => el("th", {}, h))),
    ...s.rewards.map((r) => el("tr", { testid: "reward-row" }, el("td", {}, fmtNum(r.reward), r.late ? " (late: not trained)" : ""),
      el("td", { class: "mono" }, r.completion_id || "final"), el("td", { class: "mono" }, r.key || "–"), el("td", {}, fmtTime(r.created_at)))));
  const value = el("input", { type: "number", step: "any", required: "", testid: "reward-value", name: "reward" });
  const target = el("select", { testid: "reward-target", name: "completion_id" },
    el("option", { value: "" }, "final (episode)"), ...completions.map((c) => el("option", { value: c }, c)));
  const msg = el("span", { testid: "reward-message" });
  const form = el("form", { testid: "reward-form" }, "Set reward ", value, " for ", target, " ",
    el("button", { type: "submit", testid: "reward-submit" }, "Set"), " ", msg);
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const body = { reward: Number(value.value) };
    if (target.value) body.completion_id = target.value;
    try { await api("PUT", `/sessions/${enc(sessionId)}/reward`, body); await route(); }
    catch (err) { msg.textContent = err.message; msg.className = "error"; }
  });
  // Segments whose every turn is a side request are shown apart, after the agent's own.
  const sideOnly = (g) => (g.turn_side || []).length > 0 && g.turn_side.every((r) => r);
  const own = s.segments.filter((g) => !sideOnly(g));
  const side = s.segments.filter(sideOnly);
  view().replaceChildren(
    el("p", {}, el("a", { href: "#/runs/" + enc(s.run_id) }, "← run " + s.run_id)),
    el("h1", {}, "Session ", el("span", { class: "mono" }, s.id), " ", statusBadge(s.status)),
    el("dl", { class: "kv" },
      el("dt", {}, "group"), el("dd", {}, s.group_id || "–"),
      el("dt", {}, "metadata"), el("dd", { class: "mono" }, JSON.stringify(s.metadata)),
      el("dt", {}, "prefix breaks"), el("dd", {}, s.prefix_breaks),
      el("dt", {}, "training"), el("dd", { testid: "outcome" },
        s.outcome ? `${s.outcome}${s.outcome === "trained" ? " at step " + s.consumed_step : ""}` : s.train_state),
      ...(s.failure ? [el("dt", {}, "failure"), el("dd", { class: "mono", testid: "failure" }, s.failure)] : []),
      el("dt", {}, "returns"), el("dd", { class: "mono", testid: "returns" }, JSON.stringify(s.returns))),
    el("h2", {}, "Rewards"), rewards, form,
    el("h2", {}, "Trajectory"),
    el("p", { class: "legend" }, swatch(el("span", { class: "tok sampled" }, "sampled, likely"), -0.05),
      swatch(el("span", { class: "tok sampled" }, "sampled, unlikely"), -3),
      el("span", { class: "tok masked" }, "context (loss-masked)"), el("span", { class: "tok tool" }, "tool output (loss-masked)"),
      el("span", { class: "ver" }, "v3"), " policy version of the sampled span"),
    ...own.map((g) => el("div", {}, el("h3", {}, segmentTitle(g)), renderSegment(g))),
    ...(side.length ? [el("h2", {}, "Side requests"),
      el("p", { class: "legend" }, "Recorded and answered, never trained: requests the run's side_requests rules marked (a title, a quota check)."),
      ...side.map((g) => el("div", { testid: "side-segment" }, el("h3", {}, segmentTitle(g)), renderSegment(g)))] : []));
}

function segmentTitle(g) {
  const rules = [...new Set((g.turn_side || []).filter((r) => r))];
  const marked = rules.length ? ` · side: ${rules.join(", ")}` : "";
  return `segment ${g.index} · ${g.tokens.length} tokens · ${g.completion_ids.length} turns${marked}`;
}

// --- routing ----------------------------------------------------------------------------------

async function route() {
  const seq = ++routeSeq;
  if (pollTimer) { clearInterval(pollTimer); pollTimer = null; }
  if (!token()) { showLogin(); return; }
  document.getElementById("login").hidden = true;
  document.getElementById("logout").hidden = false;
  const parts = location.hash.replace(/^#\/?/, "").split("/");
  try {
    if (parts[0] === "runs" && parts[1]) await runPage(decodeURIComponent(parts[1]), seq);
    else if (parts[0] === "sessions" && parts[1]) await sessionPage(decodeURIComponent(parts[1]), seq);
    else await runsPage(seq);
  } catch (err) {
    if (!overtaken(seq) && !(err instanceof ApiError && err.status === 401)) showError(err);
  }
}

document.getElementById("login-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value.trim());
  route();
});
document.getElementById("logout").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); route(); });
function takeTokenFromFragment() {
  const m = location.hash.match(/^#token=([^&]+)$/);
  if (!m) return;
  sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
  history.replaceState(null, "", location.pathname + location.search + "#/");
}

window.addEventListener("hashchange", () => { takeTokenFromFragment(); route(); });
takeTokenFromFragment();
route();
