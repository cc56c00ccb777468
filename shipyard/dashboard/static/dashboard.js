// shipyard dashboard: plain JavaScript over the JSON endpoints of shipyard/dashboard/app.py. No build step, no
// library, no network beyond this origin. Everything a model wrote is put on the page as text (textContent), never
// as markup; charts are SVG drawn here.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const CHARTS = [  // title, then the metric keys it draws: exact names or /patterns/
  ["reward", ["reward/mean", "reward/pass_rate"]],
  ["held-out eval", ["eval/pass@1", "eval/grounded_fraction"]],
  ["grounded tool calls", ["tools/grounded_fraction"]],
  ["KL and entropy", ["train/kl_old_new", "train/kl_sampler_trainer", "train/entropy", /^train\/distill_(loss|kl)/]],
  ["hints", ["hints/count", "hints/rollouts", /^hints\/found_/, "hints/dropped_leak"]],
  ["hint lift", [/^train\/hint_lift/]],
  ["grad norm", ["train/grad_norm"]],
  ["staleness", ["staleness/mean", "staleness/max"]],
  ["step time (s)", ["time/step_seconds", "train/seconds", "time/wait_batch_seconds"]],
  ["trainer tokens/s", ["train/tokens_per_second"]],
  ["sandbox utilisation", ["sandbox/busy_fraction", "sandbox/model_wait_fraction"]],
  ["infra failures and monitor flags", ["infra/masked", "infra/retries", "monitor/flagged"]],
];
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];

const state = {run: null, page: "curves", metrics: [], offset: 0, file: null, rollPage: 0, fleet: [], fleetPolls: 0,
  timer: null, busy: false};

// The token comes in the printed link's fragment (never sent over the network), is kept in sessionStorage (this
// origin's, port included) and removed from the address bar; every API request sends it as a bearer header.
const TOKEN = (() => {
  const m = location.hash.match(/(?:^#|&)token=([^&]+)/);
  if (m) {
    let token = m[1];
    try { token = decodeURIComponent(token); } catch (e) { /* not %-encoded: taken as written */ }
    sessionStorage.setItem("shipyard-dashboard-token", token);
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("shipyard-dashboard-token");
})();

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = String(v);
    else if (k === "class") node.setAttribute("class", v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

const $ = (id) => document.getElementById(id);
function fmt(v, d = 3) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 1e-3 || v === 0 ? v.toFixed(d) : v.toExponential(1);  // a lift of 4e-5 is not "0.000"
}
const lines = (text) => String(text ?? "").replace(/\n$/, "").split("\n");

async function api(path) {
  if (!TOKEN) throw new Error("no token: open the link `shipyard dashboard` printed (it ends in #token=…)");
  const r = await fetch(path, {headers: {Authorization: `Bearer ${TOKEN}`}, credentials: "omit"});
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || `${r.status} ${r.statusText}`);
  return body;
}

function setStatus(text, bad = false) {
  const s = $("status");
  s.textContent = text;
  s.className = bad ? "bad" : "muted";
}

// --- charts ------------------------------------------------------------------------------------------------------

function seriesOf(rows, key) {
  const pts = [];
  for (const r of rows) if (typeof r[key] === "number" && Number.isFinite(r[key])) pts.push([r.step, r[key]]);
  return pts;
}

function keysFor(rows, wanted) {
  const present = new Set(rows.flatMap(Object.keys));
  const keys = [];
  for (const w of wanted) {
    for (const k of [...present].sort()) if ((w instanceof RegExp ? w.test(k) : k === w) && !keys.includes(k)) keys.push(k);
  }
  return keys;
}

function lineChart(title, series, xLabel = "step") {  // series: [[name, [[x, y], ...]], ...]
  const W = 360, H = 180, L = 44, R = 8, T = 8, B = 22;
  const all = series.flatMap(([, pts]) => pts);
  const box = el("div", {class: "chart", "data-title": title, "data-points": all.length});
  box.append(el("h3", {text: title}));
  if (!all.length) {
    box.append(el("p", {class: "muted", text: "no data yet"}));
    return box;
  }
  // a loop, not Math.min(...all): spreading 100k+ points overflows the call stack
  let [x0, x1, y0, y1] = [Infinity, -Infinity, Infinity, -Infinity];
  for (const [x, y] of all) {
    x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
  }
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title});
  svg.append(el("svg:line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}),
    el("svg:line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"}));
  for (const [y, label] of [[y0, y0], [y1, y1]]) {
    svg.append(el("svg:text", {x: L - 4, y: sy(y) + 4, "text-anchor": "end", class: "tick", text: fmt(label, 3)}));
  }
  for (const [x, anchor] of [[x0, "start"], [x1, "end"]]) {
    svg.append(el("svg:text", {x: sx(x), y: H - 6, "text-anchor": anchor, class: "tick", text: `${xLabel} ${fmt(x, 0)}`}));
  }
  series.forEach(([, pts], i) => {
    const color = COLORS[i % COLORS.length];
    svg.append(el("svg:polyline", {points: pts.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "), fill: "none",
      stroke: color, "stroke-width": 1.6}));
    for (const p of pts) {
      const dot = el("svg:circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.4, fill: color, class: "point"});
      dot.append(el("svg:title", {text: `${xLabel} ${p[0]}: ${fmt(p[1], 4)}`}));
      svg.append(dot);
    }
  });
  box.append(svg);
  box.append(el("div", {class: "legend"}, series.map(([name], i) =>
    el("span", {}, el("i", {style: null, class: `swatch c${i % COLORS.length}`}), name))));
  return box;
}

function drawCurves() {
  const grid = $("charts");
  grid.replaceChildren(...CHARTS.map(([title, wanted]) => {
    const keys = keysFor(state.metrics, wanted);
    return lineChart(title, keys.map((k) => [k, seriesOf(state.metrics, k)]));
  }));
}

// --- runs and curves ---------------------------------------------------------------------------------------------

async function loadRuns() {
  const doc = await api("/api/runs");
  const select = $("run");
  const current = state.run;
  select.replaceChildren(...doc.runs.map((r) => el("option", {value: r.name, text: `${r.name} (${r.status}, step ${fmt(r.step)})`})));
  state.run = doc.runs.some((r) => r.name === current) ? current : (doc.runs[0] || {}).name || null;
  if (state.run) select.value = state.run;
  const run = doc.runs.find((r) => r.name === state.run);
  $("run-summary").replaceChildren(run ? el("p", {},
    el("b", {text: run.name}), ` · ${run.status} · step ${fmt(run.step)} of ${fmt(run.steps)} · model ${fmt(run.model)}`
    + ` · hints ${run.hints ? "on" : "off"}`, run.error ? el("span", {class: "bad", text: ` · ${run.error}`}) : null)
    : el("p", {class: "muted", text: `no run directories under ${doc.root}`}));
  return doc;
}

async function pollMetrics() {
  if (!state.run) return;
  const [run, offset] = [state.run, state.offset];
  const file = state.file ? `&file=${encodeURIComponent(state.file)}` : "";
  const doc = await api(`/api/runs/${encodeURIComponent(run)}/metrics?offset=${offset}${file}`);
  if (state.run !== run || state.offset !== offset) return;  // another run chosen, or a newer reply applied
  if (doc.reset) state.metrics = [];  // the log was rewritten (a resumed run): read again from its start
  for (const row of doc.rows) state.metrics.push(row);
  state.offset = doc.offset;
  state.file = doc.file;
  if (doc.rows.length || !$("charts").children.length) drawCurves();
}

// --- trajectories ------------------------------------------------------------------------------------------------

function filterQuery() {
  const form = new FormData($("filters"));
  const q = new URLSearchParams();
  for (const [k, v] of form.entries()) if (v !== "") q.set(k, v);
  q.set("offset", state.rollPage * 50);
  q.set("limit", 50);
  return q.toString();
}

function fillSelect(select, values, label) {
  const keep = select.value;
  select.replaceChildren(el("option", {value: "", text: label}), ...values.map((v) => el("option", {value: v, text: v})));
  select.value = values.map(String).includes(keep) ? keep : "";
}

async function loadRollouts() {
  if (!state.run) return;
  const doc = await api(`/api/runs/${encodeURIComponent(state.run)}/rollouts?${filterQuery()}`);
  const form = $("filters");
  fillSelect(form.elements.task, doc.tasks, "all");
  fillSelect(form.elements.step, doc.steps, "all");
  const head = el("tr", {}, ["step", "task", "#", "status", "reward", "turns", "calls", "hints", "flags"].map((h) => el("th", {text: h})));
  const rows = doc.rows.map((r) => el("tr", {class: `rollout${r.monitor_flags ? " flagged" : ""}`, tabindex: 0,
    "data-step": r.step, "data-position": r.position, onclick: () => openTrajectory(r.step, r.position)},
  [r.step, r.task, r.index, r.status, fmt(r.reward, 2), r.turns, r.tool_calls, r.hints || 0, r.monitor_flags || 0]
    .map((v) => el("td", {text: fmt(v, 2)}))));
  $("rollouts").replaceChildren(head, ...rows);
  const pages = Math.max(1, Math.ceil(doc.total / 50));
  $("pager").replaceChildren(
    el("button", {text: "‹ newer", disabled: state.rollPage === 0, onclick: () => { state.rollPage--; loadRollouts(); }}),
    ` page ${state.rollPage + 1} of ${pages} · ${doc.total} rollouts `,
    el("button", {text: "older ›", disabled: state.rollPage + 1 >= pages, onclick: () => { state.rollPage++; loadRollouts(); }}));
}

function diffView(patch) {
  const pre = el("pre", {class: "diff"});
  for (const line of lines(patch)) {
    const cls = line.startsWith("+++") || line.startsWith("---") || line.startsWith("diff ") ? "file"
      : line.startsWith("@@") ? "hunk" : line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : "ctx";
    pre.append(el("span", {class: cls, text: line + "\n"}));
  }
  return pre;
}

function editDiff(call) {  // an edit call's change, as a small diff
  const a = call.arguments || {};
  if (call.name === "search_replace") {
    return diffView([`--- ${a.path}`, `+++ ${a.path}`, ...lines(a.old_string).map((l) => `-${l}`),
      ...lines(a.new_string).map((l) => `+${l}`)].join("\n"));
  }
  if (call.name === "write_file") return diffView([`+++ ${a.path}`, ...lines(a.content).map((l) => `+${l}`)].join("\n"));
  return null;
}

function callView(call) {
  const edit = editDiff(call);
  return el("div", {class: `call${call.error ? " failed" : ""}`},
    el("div", {class: "call-head"}, el("b", {text: call.name || "(no tool)"}),
      call.untagged ? el("span", {class: "tag", text: "untagged"}) : null,
      call.error_kind ? el("span", {class: "tag bad", text: call.error_kind}) : null,
      el("span", {class: "muted", text: ` ${fmt(call.seconds, 2)} s`})),
    edit || el("pre", {class: "args", text: JSON.stringify(call.arguments, null, 1)}),
    el("pre", {class: "output", text: call.error || call.output || ""}));
}

async function openTrajectory(step, position) {
  const view = $("viewer");
  view.replaceChildren(el("p", {class: "muted", text: "loading…"}));
  let rec;
  try {
    rec = await api(`/api/runs/${encodeURIComponent(state.run)}/trajectories/${step}/${position}`);
  } catch (e) {
    view.replaceChildren(el("p", {class: "bad", text: String(e.message)}));
    return;
  }
  for (const tr of $("rollouts").querySelectorAll("tr.rollout")) {
    tr.classList.toggle("selected", Number(tr.dataset.step) === step && Number(tr.dataset.position) === position);
  }
  const traj = rec.trajectory || {turns: []};
  const verdict = rec.verdict || {};
  const hints = new Map((rec.hints || []).map((h) => [h.turn, h]));
  const flags = rec.monitor_flags || [];
  view.replaceChildren(
    el("h2", {text: `${rec.task_id} · rollout ${rec.index} · step ${step}`}),
    el("p", {class: "verdict"}, `reward ${fmt(rec.reward, 2)} · ${rec.status} · verdict ${fmt(verdict.status)}`,
      verdict.fail_to_pass && verdict.fail_to_pass.total !== undefined
        ? ` · fail→pass ${verdict.fail_to_pass.passed}/${verdict.fail_to_pass.total}` : "",
      ` · advantage ${fmt(rec.advantage, 3)} · stop ${fmt(rec.stop_reason)}`),
    flags.length ? el("div", {class: "flags"}, el("h3", {text: `monitor flags (${flags.length})`}),
      flags.map((f) => el("div", {class: "flag"}, el("b", {text: f.kind}),
        ` turn ${f.turn}${f.call === null || f.call === undefined ? " (final patch)" : `, call ${f.call}`}: `,
        el("code", {text: f.evidence})))) : null,
    ...traj.turns.map((t) => {
      const hint = hints.get(t.index);
      return el("section", {class: "turn", "data-turn": t.index},
        hint ? el("div", {class: "hint"}, el("b", {text: `hint (${(hint.kinds || []).join(", ")})`}), el("p", {text: hint.text})) : null,
        el("h3", {text: `turn ${t.index} · ${t.calls.length} call${t.calls.length === 1 ? "" : "s"} · v${t.policy_version}`}),
        el("pre", {class: "text", text: t.text}),
        t.calls.length ? el("div", {class: "calls", style: null}, t.calls.map(callView)) : null);
    }),
    el("h3", {text: "patch"}),
    traj.patch ? diffView(traj.patch) : el("p", {class: "muted", text: "no change"}));
}

// --- evals -------------------------------------------------------------------------------------------------------

async function loadEvals() {
  const runs = (await api("/api/runs")).runs;
  const refs = [];
  for (const r of runs) {
    const doc = await api(`/api/runs/${encodeURIComponent(r.name)}/evals`);
    for (const e of doc.evals) refs.push(`${r.name}/${e}`);
  }
  for (const [id, pick] of [["eval-a", 0], ["eval-b", refs.length - 1]]) {
    const s = $(id);
    const keep = s.value;
    s.replaceChildren(...refs.map((v) => el("option", {value: v, text: v})));
    s.value = refs.includes(keep) ? keep : refs[Math.max(pick, 0)] || "";
  }
  await compareEvals();
}

async function compareEvals() {
  const [a, b] = [$("eval-a").value, $("eval-b").value];
  const view = $("eval-view");
  if (!a || !b) { view.replaceChildren(el("p", {class: "muted", text: "no eval results yet"})); return; }
  const doc = await api(`/api/compare?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
  const names = Object.keys(doc.overall);
  // green where B is better: more passes, reward and grounded calls; fewer masked rollouts and monitor flags (effort:
  // neither — fewer tokens is better only for the same outcome)
  const sign = (n) => /^pass@|reward_mean|grounded_fraction/.test(n) ? 1 : /masked|monitor_flags/.test(n) ? -1 : 0;
  const cell = (v, n) => el("td", {class: sign(n) * v.delta > 0 ? "up" : sign(n) * v.delta < 0 ? "down" : ""},
    `${fmt(v.a)} → ${fmt(v.b)}`, el("small", {text: ` (${v.delta === null ? "–" : (v.delta > 0 ? "+" : "") + fmt(v.delta)})`}));
  view.replaceChildren(
    el("p", {}, `A ${a} (${fmt(doc.a.model)}) vs B ${b} (${fmt(doc.b.model)}) · ${doc.common_tasks} tasks in both`),
    el("table", {class: "table", id: "eval-table"},
      el("tr", {}, el("th", {text: "task"}), names.map((n) => el("th", {text: n}))),
      el("tr", {class: "overall"}, el("td", {text: "overall"}), names.map((n) => cell(doc.overall[n], n))),
      Object.entries(doc.tasks).map(([t, m]) => el("tr", {}, el("td", {text: t}), names.map((n) => m[n] ? cell(m[n], n) : el("td"))))));
}

// --- tasks -------------------------------------------------------------------------------------------------------

async function loadTasks() {
  if (!state.run) return;
  const doc = await api(`/api/runs/${encodeURIComponent(state.run)}/tasks`);
  $("task-list").replaceChildren(el("tr", {}, ["task", "tier", "deleted", "split"].map((h) => el("th", {text: h}))),
    ...doc.tasks.map((t) => el("tr", {class: "task", tabindex: 0, onclick: () => openTask(t.id)},
      el("td", {text: t.id}), el("td", {text: fmt(t.tier)}), el("td", {text: t.deleted.join(", ")}),
      el("td", {text: t.held_out ? "held out" : "train"}))));
  if (!doc.tasks.length) $("task-view").replaceChildren(el("p", {class: "muted", text: "this run names no task set"}));
}

async function openTask(id) {
  const doc = await api(`/api/runs/${encodeURIComponent(state.run)}/tasks/${encodeURIComponent(id)}`);
  const t = doc.task;
  $("task-view").replaceChildren(el("h2", {text: id}),
    el("p", {text: `tier ${fmt(t.tier)} · ${fmt(t.lines_deleted)} lines deleted`}),
    el("h3", {text: "statement"}), el("pre", {class: "text", text: t.statement || ""}),
    el("h3", {text: "deleted"}), el("ul", {}, (t.deleted || []).map((d) => el("li", {text: `${d.file}: ${d.qualname} (lines ${d.start}-${d.end})`}))),
    el("h3", {text: "tests to make pass"}), el("ul", {}, (t.fail_to_pass || []).map((n) => el("li", {}, el("code", {text: n})))),
    ...Object.entries(doc.tests).map(([name, text]) => el("details", {}, el("summary", {text: name}), el("pre", {class: "text", text}))));
}

// --- fleet -------------------------------------------------------------------------------------------------------

async function pollFleet() {
  const doc = await api("/api/fleet");
  const cards = $("fleet-cards");
  if (!doc.configured) {
    cards.replaceChildren(el("p", {class: "muted", text: "no environment server: start the dashboard with --env-server URL"}));
    return;
  }
  if (doc.error) {
    cards.replaceChildren(el("p", {class: "bad", text: `${doc.url}: ${doc.error}`}));
    return;
  }
  const m = doc.metrics;
  state.fleetPolls += 1;
  state.fleet.push({step: state.fleetPolls, ...flat(m)});
  if (state.fleet.length > 300) state.fleet.shift();
  const card = (label, value) => el("div", {class: "card"}, el("div", {class: "value", text: fmt(value, 2)}), el("div", {class: "label", text: label}));
  cards.replaceChildren(el("p", {class: "muted", text: doc.url}),
    card("live sandboxes", m.live), card("warm (idle)", m.warm_pool), card("queued", m.queued),
    card("grading", m.grading), card("calls in flight", m.calls_in_flight),
    card("create p50 ms", m.start_latency_ms && m.start_latency_ms.p50), card("create p99 ms", m.start_latency_ms && m.start_latency_ms.p99),
    card("load (1 min)", m.load_avg_1m), card("memory used MB", m.memory_used_mb),
    card("failures", Object.values(m.failures || {}).reduce((a, b) => a + b, 0)));
  const chart = (title, keys) => lineChart(title, keys.map((k) => [k, seriesOf(state.fleet, k)]), "poll");
  $("fleet-charts").replaceChildren(
    chart("sandboxes", ["live", "warm_pool", "queued", "grading", "calls_in_flight"]),
    chart("create latency ms", ["start_latency_ms/p50", "start_latency_ms/p99"]),
    chart("load (1 min)", ["load_avg_1m"]),
    chart("memory used MB", ["memory_used_mb"]));
}

function flat(obj, prefix = "", out = {}) {
  for (const [k, v] of Object.entries(obj || {})) {
    if (v && typeof v === "object" && !Array.isArray(v)) flat(v, `${prefix}${k}/`, out);
    else out[`${prefix}${k}`] = v;
  }
  return out;
}

// --- wiring ------------------------------------------------------------------------------------------------------

function show(page) {
  state.page = page;
  for (const b of $("tabs").querySelectorAll("button")) b.classList.toggle("active", b.dataset.page === page);
  for (const s of document.querySelectorAll("main > section")) s.hidden = s.id !== `page-${page}`;
  refresh(true);
}

async function refresh(first = false) {
  if (state.busy && !first) return;  // a slow reply: skip this tick rather than overlap it
  state.busy = true;
  try {
    await loadRuns();
    if (state.page === "curves") await pollMetrics();
    else if (state.page === "trajectories") await loadRollouts();
    else if (state.page === "evals" && first) await loadEvals();
    else if (state.page === "tasks" && first) await loadTasks();
    else if (state.page === "fleet") await pollFleet();
    setStatus(`updated ${new Date().toLocaleTimeString()}`);
  } catch (e) {
    setStatus(String(e.message), true);
  } finally {
    state.busy = false;
  }
}

function start() {
  for (const b of $("tabs").querySelectorAll("button")) b.addEventListener("click", () => show(b.dataset.page));
  $("run").addEventListener("change", () => {
    state.run = $("run").value;
    state.metrics = []; state.offset = 0; state.file = null; state.rollPage = 0;
    $("charts").replaceChildren();
    refresh(true);
  });
  $("filters").addEventListener("change", () => { state.rollPage = 0; loadRollouts().catch((e) => setStatus(e.message, true)); });
  $("filters").addEventListener("submit", (e) => e.preventDefault());
  $("eval-a").addEventListener("change", () => compareEvals().catch((e) => setStatus(e.message, true)));
  $("eval-b").addEventListener("change", () => compareEvals().catch((e) => setStatus(e.message, true)));
  show("curves");
  state.timer = setInterval(() => refresh(false), POLL_MS);
}

document.addEventListener("DOMContentLoaded", start);
