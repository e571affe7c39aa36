// The web UI of `sluice server`: a job list with live progress, a job page (stage DAG, task
// timeline across workers, per-stage skew, cancel) and a worker page, all drawn from the REST API
// (/api/v1/...). No build step and nothing fetched from elsewhere: the server compiles this file in.
"use strict";

const LIST_LIMIT = 500; // newest jobs shown in the list
const main = document.getElementById("main");
const status = document.getElementById("status");
let timer = null;

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) =>
    ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// Thrown when the server wants a login: the page shows the login form instead.
class LoginNeeded extends Error {}

async function get(path) {
  const response = await fetch(path);
  const body = await response.json();
  if (response.status === 401) throw new LoginNeeded(body.error);
  if (!response.ok) throw new Error(body.error || `${path}: ${response.status}`);
  return body;
}

// The login form of a server with user accounts: the server answers with an HttpOnly cookie
// that later requests carry, so this page never holds the token.
function showLogin(message) {
  clearInterval(timer);
  main.innerHTML = `<h1>Log in</h1>
    <form id="login"><p class="note">${esc(message)}</p>
      <label>User <input name="user" autocomplete="username" required></label>
      <label>Password <input name="password" type="password" autocomplete="current-password" required></label>
      <button type="submit">Log in</button><p class="error" id="login-error"></p></form>`;
  document.getElementById("login").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = new FormData(event.target);
    const response = await fetch("/api/v1/login", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ user: form.get("user"), password: form.get("password") }),
    });
    const body = await response.json();
    if (response.ok) route();
    else document.getElementById("login-error").textContent = body.error;
  });
}

function ms(value) {
  if (value == null) return "";
  return value < 1000 ? `${value} ms` : `${(value / 1000).toFixed(value < 10000 ? 2 : 1)} s`;
}

function bytes(value) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = value || 0, u = 0;
  while (v >= 1024 && u < units.length - 1) { v /= 1024; u++; }
  return `${u ? v.toFixed(1) : v} ${units[u]}`;
}

// Runs `refresh` now and every second while it returns true.
function every(refresh) {
  clearInterval(timer);
  const tick = async () => {
    try {
      const again = await refresh();
      status.textContent = `updated ${new Date().toLocaleTimeString()}`;
      if (!again) clearInterval(timer);
    } catch (error) {
      if (error instanceof LoginNeeded) showLogin(error.message);
      else status.textContent = `error: ${error.message}`;
    }
  };
  tick();
  timer = setInterval(tick, 1000);
}

function route() {
  const job = location.hash.match(/^#\/jobs\/(\d+)$/);
  if (job) every(() => showJob(Number(job[1])));
  else if (location.hash === "#/workers") every(showWorkers);
  else every(showJobs);
}

async function showJobs() {
  const jobs = (await get("/api/v1/jobs")).reverse();
  const shown = jobs.slice(0, LIST_LIMIT);
  const rows = shown.map((j) => `
    <tr class="job" data-job="${j.id}" data-state="${j.state}">
      <td class="num"><a href="#/jobs/${j.id}">${j.id}</a></td>
      <td class="state ${j.state}">${j.state}</td>
      <td><span class="bar"><span style="width:${j.tasks ? (100 * j.tasks_done) / j.tasks : 0}%"></span></span>
          ${j.tasks_done}/${j.tasks}</td>
      <td class="num">${j.rows}</td><td class="num">${ms(j.elapsed_ms)}</td>
      <td class="num">${j.retries}</td><td>${esc(j.user)}</td>
      <td class="sql" title="${esc(j.sql)}">${esc(j.sql)}</td>
    </tr>`).join("");
  const more = jobs.length > shown.length
    ? `<p class="note">${jobs.length - shown.length} older jobs not shown (the REST API lists them).</p>` : "";
  main.innerHTML = `<h1>Jobs</h1>
    <table id="jobs"><thead><tr><th class="num">job</th><th>state</th><th>tasks</th><th class="num">rows</th>
    <th class="num">elapsed</th><th class="num">retries</th><th>user</th><th>SQL</th></tr></thead>
    <tbody>${rows}</tbody></table>${more}`;
  return true;
}

async function cancel(id) {
  const response = await fetch(`/api/v1/jobs/${id}/cancel`, { method: "POST" });
  const body = await response.json();
  status.textContent = response.ok ? `job ${id}: cancel sent` : `job ${id}: ${body.error}`;
  route();
}

async function showJob(id) {
  const job = await get(`/api/v1/jobs/${id}`);
  const running = job.state === "running";
  main.innerHTML = `
    <h1>Job ${job.id} <span class="state ${job.state}" id="job-state">${job.state}</span>
      ${running ? `<button id="cancel">Cancel</button>` : ""}</h1>
    <p class="facts"><span>${job.tasks_done}/${job.tasks} tasks</span><span>${job.rows} rows</span>
      <span>${ms(job.elapsed_ms)}</span><span>${job.retries} retries</span>
      <span>${esc(job.user ?? "")}</span><span>${esc(job.tag ?? "")}</span></p>
    ${job.sql ? `<pre class="sql">${esc(job.sql)}</pre>` : ""}
    ${job.error ? `<p class="error">${esc(job.error)}</p>` : ""}
    <h2>Stages</h2>${dag(job)}
    <h2>Tasks across workers</h2>${timeline(job)}
    <h2>Skew per stage</h2>${skew(job)}`;
  const button = document.getElementById("cancel");
  if (button) button.onclick = () => cancel(id);
  return running;
}

// The job graph: a column per depth (sources left, the final stage right), edges with their mode.
function dag(job) {
  const stages = job.graph, depth = [];
  const depthOf = (s) => depth[s] ?? (depth[s] = stages[s].inputs.length
    ? 1 + Math.max(...stages[s].inputs.map((i) => depthOf(i.stage))) : 0);
  stages.forEach((s) => depthOf(s.stage));
  const rowIn = [], perDepth = [];
  stages.forEach((s) => { const d = depth[s.stage]; rowIn[s.stage] = (perDepth[d] = (perDepth[d] || 0) + 1) - 1; });
  const W = 190, H = 58, GX = 70, GY = 18;
  const x = (s) => 10 + depth[s] * (W + GX), y = (s) => 10 + rowIn[s] * (H + GY);
  const width = 20 + (Math.max(...depth) + 1) * (W + GX) - GX, height = 20 + Math.max(...perDepth) * (H + GY) - GY;
  const details = job.stage_details;
  const edges = stages.flatMap((s) => s.inputs.map((i) => {
    const x1 = x(i.stage) + W, y1 = y(i.stage) + H / 2, x2 = x(s.stage) - 4, y2 = y(s.stage) + H / 2;
    return `<path class="edge" d="M${x1},${y1} C${x1 + GX / 2},${y1} ${x2 - GX / 2},${y2} ${x2},${y2}"/>
      <text x="${(x1 + x2) / 2 - 20}" y="${(y1 + y2) / 2 - 4}">${esc(i.mode)}</text>`;
  })).join("");
  const boxes = stages.map((s) => {
    const d = details[s.stage];
    const done = d.succeeded === d.tasks ? " done" : "";
    return `<g class="stage${done}" data-stage="${s.stage}">
      <rect x="${x(s.stage)}" y="${y(s.stage)}" width="${W}" height="${H}" rx="6"/>
      <text x="${x(s.stage) + 8}" y="${y(s.stage) + 16}" font-weight="600">Stage ${s.stage}</text>
      <text x="${x(s.stage) + 8}" y="${y(s.stage) + 32}">${esc(s.root)}</text>
      <text x="${x(s.stage) + 8}" y="${y(s.stage) + 48}">${d.succeeded}/${d.tasks} tasks · ${d.rows} rows</text>
    </g>`;
  }).join("");
  return `<svg class="dag" width="${width}" height="${height}">
    <defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6"
      orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#8c959f"/></marker></defs>${edges}${boxes}</svg>`;
}

// A Gantt view: a lane per worker, a bar per task attempt from placement to its end.
function timeline(job) {
  const attempts = job.attempts;
  if (!attempts.length) return `<p class="note">No task has been placed yet.</p>`;
  const lanes = [...new Set(attempts.map((a) => a.address))].sort();
  const now = Date.now();
  const start = Math.min(...attempts.map((a) => a.started_ms));
  const end = Math.max(...attempts.map((a) => a.ended_ms ?? now), start + 1);
  const LABEL = 170, WIDTH = 900;
  const scale = (t) => LABEL + ((t - start) / (end - start)) * (WIDTH - LABEL - 10);
  // Attempts of one lane that overlap in time get sub-rows, so every bar stays visible.
  const slots = lanes.map(() => []);
  const placed = attempts.map((a) => {
    const lane = lanes.indexOf(a.address), finish = a.ended_ms ?? now;
    let row = slots[lane].findIndex((free) => free <= a.started_ms);
    if (row < 0) { row = slots[lane].length; slots[lane].push(0); }
    slots[lane][row] = finish;
    return { a, lane, row, finish };
  });
  const rowsOf = slots.map((s) => Math.max(1, s.length));
  const top = rowsOf.map((_, i) => rowsOf.slice(0, i).reduce((n, r) => n + r, 0));
  // Bars stay 10 px high up to 25 overlapping attempts a lane, then shrink to fit 250 px.
  const bar = Math.max(3, Math.min(10, Math.floor(250 / Math.max(...rowsOf))));
  const total = rowsOf.reduce((n, r) => n + r, 0);
  const rowHeight = (i) => rowsOf[i] * bar + 8;
  const laneY = (i) => 20 + top[i] * bar + i * 8;
  const labels = lanes.map((address, i) =>
    `<text x="6" y="${laneY(i) + rowHeight(i) / 2}">${esc(address)}</text>`).join("");
  const bars = placed.map(({ a, lane, row, finish }) => {
    const x = scale(a.started_ms), w = Math.max(2, scale(finish) - x);
    return `<rect class="attempt ${a.state}" data-stage="${a.stage}" data-partition="${a.partition}"
      data-attempt="${a.attempt}" x="${x}" y="${laneY(lane) + row * bar}" width="${w}" height="${bar - 1}">
      <title>stage ${a.stage} partition ${a.partition} attempt ${a.attempt}: ${a.state}, ${ms(a.task_ms)} (compute ${ms(a.compute_ms)}), ${a.input_rows} rows in, ${a.rows} rows out, read ${bytes(a.read_local_bytes)} local + ${bytes(a.read_remote_bytes)} over Flight, peak memory ${bytes(a.peak_memory_bytes)}${a.spill_count ? ", " + a.spill_count + " spills" : ""}${a.error ? "\n" + esc(a.error) : ""}</title></rect>`;
  }).join("");
  const height = 30 + total * bar + lanes.length * 8;
  return `<svg class="timeline" width="${WIDTH}" height="${height}">
    <text x="${LABEL}" y="12">0</text><text x="${WIDTH - 60}" y="12">${ms(end - start)}</text>
    ${labels}${bars}</svg>`;
}

// Per stage: how task time and rows spread (largest over median; 1.0 is even), with a bar.
function skew(job) {
  const rows = job.stage_details.map((s) => {
    const ratio = s.task_ms_median ? s.task_ms_max / s.task_ms_median : null;
    const width = ratio ? Math.min(200, 40 * ratio) : 0;
    return `<tr data-stage="${s.stage}"><td class="num">${s.stage}</td><td class="num">${s.succeeded}/${s.tasks}</td>
      <td class="num">${s.attempts}</td><td class="num">${s.rows}</td><td class="num">${bytes(s.shuffled_bytes)}</td>
      <td class="num">${bytes(s.spilled_bytes)}</td><td class="num">${bytes(s.read_remote_bytes)}</td>
      <td class="num">${bytes(s.peak_memory_bytes)}</td><td class="num">${ms(s.task_ms_median)}</td>
      <td class="num">${ms(s.task_ms_max)}</td><td class="num">${s.task_rows_median ?? ""}</td>
      <td class="num">${s.task_rows_max ?? ""}</td>
      <td><svg width="210" height="12" style="border:0"><rect x="0" y="2" width="${width}" height="8"
        fill="${ratio > 2 ? "#cf222e" : "#1f6feb"}"/></svg> ${ratio ? ratio.toFixed(2) : ""}</td></tr>`;
  }).join("");
  return `<table id="skew"><thead><tr><th class="num">stage</th><th class="num">tasks</th><th class="num">attempts</th>
    <th class="num">rows</th><th class="num">shuffled</th><th class="num">spilled</th><th class="num">read over Flight</th>
    <th class="num">peak memory (task)</th><th class="num">task time median</th>
    <th class="num">max</th><th class="num">rows median</th><th class="num">max</th><th>time skew (max / median)</th></tr></thead>
    <tbody>${rows}</tbody></table>`;
}

async function showWorkers() {
  const workers = await get("/api/v1/workers");
  const rows = workers.map((w) => `<tr class="worker"><td>${esc(w.address)}</td>
    <td class="num">${w.slots ?? ""}</td><td class="num">${w.busy_slots ?? ""}</td>
    <td class="num">${w.running_tasks}</td><td class="num">${w.live_attempts}</td>
    <td class="num">${w.stream_outputs}</td><td class="num">${bytes(w.memory_used)}</td>
    <td class="num">${w.memory_limit == null ? "unlimited" : bytes(w.memory_limit)}</td>
    <td class="num">${w.last_heartbeat_ms_ago == null ? "" : ms(w.last_heartbeat_ms_ago) + " ago"}</td></tr>`).join("");
  main.innerHTML = `<h1>Workers</h1><table id="workers"><thead><tr><th>address</th><th class="num">slots</th>
    <th class="num">busy</th><th class="num">running tasks</th>
    <th class="num">live attempts</th><th class="num">stream outputs</th><th class="num">memory used</th>
    <th class="num">memory limit</th><th class="num">last heartbeat</th></tr></thead>
    <tbody>${rows}</tbody></table>`;
  return true;
}

window.addEventListener("hashchange", route);
route();
