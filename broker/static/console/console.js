// The flowbroker web console (docs/console.md). Plain JS, no build step: it polls the admin JSON API
// every second with the session cookie and its header value (from the login, in this origin's
// localStorage: a browser sends the cookie to every port of the host, never this) and keeps the depth history itself (bounded), so the broker
// keeps nothing for it. Every name a client chose is put in the page with textContent, never as HTML.
"use strict";

const POLL_MS = 1000;
const HISTORY_SECONDS = 300;   // what a chart shows
const CHARTS = 6;              // charts for the deepest queues only
const THRESHOLDS = ["flow_stop_count", "flow_resume_count", "flow_stop_size", "flow_resume_size",
                    "flow_stop_drain_time", "flow_resume_drain_time", "flow_stop_age", "flow_resume_age"];
// The time thresholds (docs/policies.md "Time thresholds") take seconds, fractions allowed; the others
// are whole messages or bytes.
const TIME_THRESHOLDS = new Set(["flow_stop_drain_time", "flow_resume_drain_time", "flow_stop_age", "flow_resume_age"]);

const CSRF_KEY = "flowbroker-csrf";  // where login.js left the session's header value
let latestQueues = new Map();  // name -> queue view of the last poll
const history = new Map();     // name -> {t, count, bytes, stopCount, resumeCount, stopSize, resumeSize}
const charts = new Map();      // name -> {plot, element, unit}

// -- the API --------------------------------------------------------------------------------------

async function api(method, path, body) {
  // Every request, reads too (docs/console.md); read afresh each time: a login in another tab of this
  // origin replaced the cookie's session, and its value with it.
  const headers = {"X-Flowbroker-CSRF": window.localStorage.getItem(CSRF_KEY) || ""};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 401 || (response.status === 403 && path === "/session")) {
    // logged out elsewhere, the session expired, or this page has no header value for it
    window.localStorage.removeItem(CSRF_KEY);
    window.location.assign("/login");
    throw new Error("the session has ended");
  }
  const text = await response.text().catch(() => "");
  let answer = null;
  try { answer = JSON.parse(text); } catch (e) { answer = null; }
  if (!response.ok) {
    throw new Error(answer && answer.error ? answer.error.message : httpError(response.status, text));
  }
  return answer;
}

function httpError(status, text) {
  // An answer that is not the API's JSON: the admin port's own 503 when max_connections are open says so in
  // a line of text, which the console showed as a bare "HTTP 503" (docs/management.md, "Connections at once")
  const line = text.trim().split("\n")[0].slice(0, 200);
  return line ? `HTTP ${status}: ${line}` : `HTTP ${status}`;
}

// -- formatting -----------------------------------------------------------------------------------

function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return i === 0 ? `${n} B` : `${n.toFixed(n < 10 ? 2 : 1)} ${units[i]}`;
}

function threshold(value, format) {
  return value ? format(value) : "off";
}

// A queue's time thresholds after its count / size ones, only those that are on: "" when none is.
function timeThresholds(th, drain, age) {
  const parts = [];
  if (th[drain]) parts.push(`drain ${th[drain]} s`);
  if (th[age]) parts.push(`age ${th[age]} s`);
  return parts.length ? ` · ${parts.join(" · ")}` : "";
}

// A stop reason's value and limit: the time thresholds report milliseconds.
function reasonText(r) {
  const unit = TIME_THRESHOLDS.has(r.threshold) ? " ms" : "";
  return `${r.threshold} ${r.value}${unit} > ${r.limit}${unit}`;
}

function since(seconds) {
  const at = new Date(Date.now() - seconds * 1000);
  return `for ${seconds.toFixed(1)} s (since ${at.toLocaleTimeString()})`;
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

// -- history and charts ---------------------------------------------------------------------------

function record(queue, t) {
  let h = history.get(queue.name);
  if (!h) {
    h = {t: [], count: [], bytes: [], stopCount: [], resumeCount: [], stopSize: [], resumeSize: []};
    history.set(queue.name, h);
  }
  const th = queue.thresholds;
  h.t.push(t);
  h.count.push(queue.depth.count);
  h.bytes.push(queue.depth.bytes);
  h.stopCount.push(th.flow_stop_count || null);       // 0 is "off": no line
  h.resumeCount.push(th.flow_resume_count || null);
  h.stopSize.push(th.flow_stop_size || null);
  h.resumeSize.push(th.flow_resume_size || null);
  while (h.t.length && h.t[0] < t - HISTORY_SECONDS) {
    for (const key of Object.keys(h)) h[key].shift();
  }
}

// A queue is charted in messages when it has a count threshold, else in bytes (its size thresholds).
function unitOf(queue) {
  return queue.thresholds.flow_stop_count ? "messages" : "bytes";
}

function chartData(name, unit) {
  const h = history.get(name);
  return unit === "messages"
    ? [h.t, h.count, h.stopCount, h.resumeCount]
    : [h.t, h.bytes, h.stopSize, h.resumeSize];
}

function makeChart(name, unit) {
  const element = document.createElement("div");
  element.className = "chart";
  element.dataset.queue = name;
  const title = document.createElement("h3");
  title.textContent = `${name} (${unit})`;
  element.appendChild(title);
  const values = unit === "bytes" ? (u, ticks) => ticks.map(bytes) : undefined;
  const plot = new uPlot({
    width: 600, height: 240,
    scales: {x: {time: true}, y: {range: (u, min, max) => [0, Math.max(1, max * 1.1)]}},
    series: [
      {},
      {label: "depth", stroke: "#1565c0", width: 2, fill: "rgba(21,101,192,0.10)",
       value: (u, v) => v === null ? "" : (unit === "bytes" ? bytes(v) : String(v))},
      {label: "flow stop", stroke: "#b3261e", width: 1.5, dash: [6, 4]},
      {label: "flow resume", stroke: "#2e7d32", width: 1.5, dash: [6, 4]},
    ],
    axes: [{}, {label: unit, size: 70, values}],
  }, chartData(name, unit), element);
  return {plot, element, unit};
}

function drawCharts(queues) {
  const container = document.getElementById("charts");
  const deepest = [...queues].sort((a, b) => b.depth.bytes - a.depth.bytes || (a.name < b.name ? -1 : 1))
    .slice(0, CHARTS);
  const wanted = new Set(deepest.map((q) => q.name));
  for (const [name, chart] of charts) {
    if (!wanted.has(name)) { chart.plot.destroy(); chart.element.remove(); charts.delete(name); }
  }
  for (const queue of deepest) {
    const unit = unitOf(queue);
    let chart = charts.get(queue.name);
    if (chart && chart.unit !== unit) { chart.plot.destroy(); chart.element.remove(); chart = undefined; }
    if (!chart) {
      chart = makeChart(queue.name, unit);
      charts.set(queue.name, chart);
    } else {
      chart.plot.setData(chartData(queue.name, unit));
    }
    container.appendChild(chart.element);  // keeps them in depth order
  }
}

// -- tables ---------------------------------------------------------------------------------------

function drawQueues(queues) {
  const body = document.querySelector("#queues tbody");
  body.replaceChildren();
  for (const q of queues) {
    const row = document.createElement("tr");
    row.dataset.queue = q.name;
    const th = q.thresholds;
    cell(row, q.name, "name");
    cell(row, String(q.depth.count), "num depth");
    cell(row, bytes(q.depth.bytes), "num");
    cell(row, `${threshold(th.flow_stop_count, String)} / ${threshold(th.flow_stop_size, bytes)}` +
         timeThresholds(th, "flow_stop_drain_time", "flow_stop_age"), "stop");
    cell(row, `${threshold(th.flow_resume_count, String)} / ${threshold(th.flow_resume_size, bytes)}` +
         timeThresholds(th, "flow_resume_drain_time", "flow_resume_age"), "resume");
    if (q.saturated) {
      const r = q.stop_reason;
      cell(row, `yes ${since(q.saturated_for_seconds)}${r ? `: ${reasonText(r)}` : ""}`,
           "saturated yes");
    } else {
      cell(row, "no", "saturated no");
    }
    cell(row, String(q.held_transfers), "num held");
    const producers = q.flow_stopped_producers.map((p) => `${p.connection}:${p.client_name}`);
    const more = q.flow_stopped_producers_total - q.flow_stopped_producers.length;
    cell(row, producers.join(", ") + (more > 0 ? ` (+${more} more)` : ""), "stopped-producers");
    body.appendChild(row);
  }
}

function drawConnections(connections) {
  const body = document.querySelector("#connections tbody");
  body.replaceChildren();
  for (const c of connections) {
    const row = document.createElement("tr");
    row.dataset.connection = String(c.id);
    row.dataset.client = c.client_name;
    cell(row, String(c.id), "num");
    cell(row, c.client_name, "client");
    cell(row, c.peer || "", "peer");
    cell(row, c.role, "role");
    cell(row, c.flow_control ? bytes(c.producer.buffer_size) : "not paced", "num granted");
    cell(row, bytes(c.producer.unacked_bytes), "num unacked");
    cell(row, String(c.producer.transfers_held), "num held");
    if (c.flow.stopped) {
      cell(row, `stopped ${since(c.flow.stopped_for_seconds)}`, "flow stopped");
    } else {
      cell(row, "running", "flow running");
    }
    const destinations = c.flow.destinations.map((d) =>
      d.destination === "*" ? `* (${d.reason === "memory" ? "memory alarm" : "stop-all"})`
                            : `${d.destination} (${reasonText(d)})`);
    const more = c.flow.destinations_total - c.flow.destinations.length;
    cell(row, destinations.join(", ") + (more > 0 ? ` (+${more} more)` : ""), "destinations");
    body.appendChild(row);
  }
}

// -- the thresholds form --------------------------------------------------------------------------

// The values the form was filled with, and the fields the operator typed in since: only those are sent,
// so a change someone else made meanwhile (the CLI, another console) is not undone by a stale field. A
// field typed back to its filled value is sent too (compared with the filled value alone, a threshold
// typed back to what it was before someone else changed it was dropped, "Nothing to change": a tester).
let filled = {};
const edited = new Set();

function fillForm(name) {
  const queue = latestQueues.get(name);
  filled = {};
  edited.clear();
  for (const key of THRESHOLDS) {
    filled[key] = queue ? String(queue.thresholds[key]) : "";
    document.getElementById(key).value = filled[key];
  }
}

function drawQueueChoice(queues) {
  const select = document.getElementById("threshold-queue");
  const names = queues.map((q) => q.name);
  const current = [...select.options].map((o) => o.value);
  if (names.length === current.length && names.every((n, i) => n === current[i])) return;
  const chosen = select.value;
  select.replaceChildren(...names.map((n) => { const o = document.createElement("option"); o.value = n; o.textContent = n; return o; }));
  if (names.includes(chosen)) {
    select.value = chosen;
  } else if (names.length) {
    select.value = names[0];
    fillForm(names[0]);
  }
}

const MAX_THRESHOLD = 2 ** 50;  // a count or size threshold's largest (the admin API refuses beyond)

async function applyThresholds(event) {
  event.preventDefault();
  const result = document.getElementById("thresholds-result");
  const name = document.getElementById("threshold-queue").value;
  const queue = latestQueues.get(name);
  if (!queue) return;
  if (name === "." || name === "..") {  // the browser folds the path: the request would name another resource
    result.className = "error";
    result.textContent = `Queue '${name}' cannot be changed from this page (the browser folds '${name}' out of ` +
                         `the request's path): use flowbroker queue set (docs/console.md).`;
    return;
  }
  const change = {};
  for (const key of THRESHOLDS) {
    const text = document.getElementById(key).value.trim();
    if (text === "" || (text === filled[key] && !edited.has(key))) continue;
    const value = Number(text);
    const valid = TIME_THRESHOLDS.has(key) ? Number.isFinite(value) && value >= 0
                                           : Number.isSafeInteger(value) && value >= 0 && value <= MAX_THRESHOLD;
    if (!valid) {
      result.className = "error";
      // the broker's own rule and words (1e20 was "must be an integer >= 0", a tester)
      result.textContent = TIME_THRESHOLDS.has(key) ? `${key} must be a number of seconds >= 0 (0 = off)`
                                                     : `${key} must be an integer in [0, 2^50] (0 = off)`;
      return;
    }
    change[key] = value;
  }
  const keys = Object.keys(change);
  if (!keys.length) {
    result.className = "error";
    result.textContent = "Nothing to change: edit a threshold first.";
    return;
  }
  const what = keys.map((k) => `${k}: ${queue.thresholds[k]} -> ${change[k]}`).join("\n");
  if (!window.confirm(`Change the thresholds of queue '${name}'?\n\n${what}`)) return;
  try {
    const answer = await api("PATCH", `/api/queues/${encodeURIComponent(name)}`, change);
    result.className = "ok";
    result.textContent = `Queue '${name}': ${THRESHOLDS.map((k) => `${k} ${answer.thresholds[k]}`).join(", ")}` +
      (answer.saturated ? " (still saturated)" : "");
    latestQueues.set(name, answer);
    fillForm(name);
  } catch (e) {
    result.className = "error";
    result.textContent = `Refused: ${e.message}`;
  }
}

// -- stop-all, start-all, logout ------------------------------------------------------------------

async function producers(action, question) {
  const result = document.getElementById("action-result");
  if (!window.confirm(question)) return;
  try {
    const answer = await api("POST", `/api/producers/${action}`);
    result.className = "ok";
    result.textContent = `${action}: producers ${answer.producers_stopped ? "stopped" : "running"} ` +
      `(${answer.connections.length} flow-controlled connection(s))`;
  } catch (e) {
    result.className = "error";
    result.textContent = `${action} failed: ${e.message}`;
  }
}

// -- the poll -------------------------------------------------------------------------------------

async function poll() {
  try {
    const [broker, q, s, c] = await Promise.all([
      api("GET", "/api/broker"),
      api("GET", "/api/queues?limit=1000"),
      // the saturated queues wherever their names sort: 1,000 queues named before one hid it
      api("GET", "/api/queues?saturated=true&limit=1000"),
      api("GET", "/api/connections?limit=1000"),
    ]);
    const t = Date.now() / 1000;
    latestQueues = new Map(q.queues.map((queue) => [queue.name, queue]));
    for (const queue of s.queues) latestQueues.set(queue.name, queue);
    const queues = [...latestQueues.values()].sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
    for (const queue of queues) record(queue, t);
    for (const name of [...history.keys()]) if (!latestQueues.has(name)) history.delete(name);
    // a held transfer counts once per connection (Connection.transfers_held), not once per queue that
    // holds it; counted over the listed connections, said so when that list was cut
    const held = c.connections.reduce((sum, conn) => sum + conn.producer.transfers_held, 0);
    const ofConnections = c.next !== null ? ` by the first ${c.connections.length} connections` : "";
    document.getElementById("broker-summary").textContent =
      `${broker.name}: ${broker.connections} connection(s), ${broker.queues} queue(s), ` +
      `${broker.saturated_queues} saturated, ${held} transfer(s) held${ofConnections}`;
    const banner = document.getElementById("banner");
    banner.hidden = !broker.producers_stopped;
    banner.textContent = broker.producers_stopped
      ? "Every producer is stopped (stop-all): their sends wait until Start all producers." : "";
    drawQueueChoice(queues);
    drawQueues(queues);
    drawConnections(c.connections);
    drawCharts(queues);
    // what was left out: a saturated queue past the first 1000 names is still listed, unless more than
    // 1000 are saturated (queues anyone may declare can push it out: a tester made 1000)
    const cut = [];
    if (q.next !== null) cut.push(s.next !== null ? "the first 1000 queues" : "the first 1000 queues, and every saturated one");
    if (s.next !== null) cut.push("the first 1000 saturated queues by name");
    if (c.next !== null) cut.push("the first 1000 connections");
    const partial = cut.length ? ` (${cut.join("; ")})` : "";
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}${partial}`;
  } catch (e) {
    document.getElementById("updated").textContent = `not updated: ${e.message}`;
  }
  polls += 1;
  if (polls % SESSION_EVERY === 0) await showSession();
  setTimeout(poll, POLL_MS);
}

let polls = 0;
const SESSION_EVERY = 5;  // polls between looks at /session: a user demoted (or promoted) since is shown so

async function showSession() {
  // The broker refuses a demoted user's changes from its next request; the page shows it within seconds
  // (it kept its buttons until a reload, a tester).
  const session = await api("GET", "/session").catch(() => null);
  if (session === null) return;
  for (const id of ["stop-all", "start-all", "thresholds-section"]) document.getElementById(id).hidden = session.read_only;
  document.getElementById("read-only").hidden = !session.read_only;
}

async function start() {
  if (window.localStorage.getItem(CSRF_KEY) === null) {  // the cookie alone opens nothing: log in again
    window.location.assign("/login");
    return;
  }
  // a monitoring user's session: the broker refuses changes (403 read_only), so offer none
  await showSession();
  document.getElementById("stop-all").addEventListener("click", () =>
    producers("stop-all", "Stop every producer of this broker? Their sends wait until you start them again."));
  document.getElementById("start-all").addEventListener("click", () =>
    producers("start-all", "Start every producer again?"));
  document.getElementById("threshold-queue").addEventListener("change", (e) => fillForm(e.target.value));
  document.getElementById("thresholds-form").addEventListener("submit", applyThresholds);
  for (const key of THRESHOLDS) document.getElementById(key).addEventListener("input", () => edited.add(key));
  document.getElementById("logout").addEventListener("click", async () => {
    await api("POST", "/logout").catch(() => null);
    window.localStorage.removeItem(CSRF_KEY);
    window.location.assign("/login");
  });
  poll();
}

start();
