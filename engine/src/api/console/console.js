// The onceflow console: the same HTTP API as every client, in plain
// JavaScript. The token (when the server wants one) is kept in this tab's
// sessionStorage and sent as `Authorization: Bearer …`, never in a URL.
// Job pages are refreshed with fetch; a streamed job's output is read from
// its event stream with fetch too (EventSource cannot send headers).
"use strict";

const $ = (id) => document.getElementById(id);
const STATES = ["received", "generated", "persisted", "claimed", "delivered", "acked", "dead", "cancelled"];
const LIVE = new Set(["received", "generated", "persisted", "claimed", "delivered"]);
let cursors = [];      // the cursor of each page shown, for "Newest"
let nextCursor = null; // the page after this one
let refresh = null;
let watching = null;   // the streamed job whose output is read: {id, controller, ended}

// Stops reading a job's event stream (the page left it).
function stopWatching() {
  if (watching) { watching.controller.abort(); watching = null; }
}

// Shows a streamed job's output as it is journaled: its event stream
// (chunks, resets, tool calls) read until the server ends it after the
// final state. What shows is what every watcher sees: the text since the
// last reset, and each tool call's phases.
async function watchOutput(id) {
  if (watching && watching.id === id) return;
  stopWatching();
  const controller = new AbortController();
  const mine = { id, controller, ended: false };
  watching = mine;
  const out = $("job-output");
  const activity = $("job-activity");
  out.textContent = "";
  activity.replaceChildren();
  let text = "";
  const headers = {};
  if (token()) headers["Authorization"] = "Bearer " + token();
  try {
    const response = await fetch("/v1/jobs/" + encodeURIComponent(id) + "/events",
      { headers, signal: controller.signal });
    if (response.status !== 200) return;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        if (controller.signal.aborted) return; // the page moved on
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const line = frame.split("\n").find((l) => l.startsWith("data: "));
        if (!line) continue; // a keep-alive comment
        let event;
        try { event = JSON.parse(line.slice("data: ".length)); } catch (e) { continue; }
        if (event.kind === "chunk") {
          text += event.text;
        } else if (event.kind === "reset") {
          text = "";
        } else if (event.kind === "tool" && event.tool) {
          const li = document.createElement("li");
          li.textContent = `${event.tool.name} (${event.tool.tool_call_id}): ${event.text}`;
          li.dataset.phase = event.text;
          activity.appendChild(li);
        }
        out.textContent = text;
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") say("the output stream stopped: " + e.message);
  } finally {
    // Ended (the job finished, or the connection dropped): a later refresh
    // that finds the job live again reads it anew.
    mine.ended = true;
  }
}

function token() { return sessionStorage.getItem("onceflow-token"); }

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token()) headers["Authorization"] = "Bearer " + token();
  if (options.body) headers["Content-Type"] = "application/json";
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) {
    showLogin();
    throw new Error("unauthorized");
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const message = body && body.error ? body.error.message : "HTTP " + response.status;
    throw new Error(message);
  }
  return body;
}

function say(text) { $("status").textContent = text || ""; }

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text == null ? "" : String(text);
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

// A live job that waits (a timer, a signal, an approval, children) reads
// as waiting, not as the state it waits in.
// What a job waits for, in words: a durable wait by its name, a key's
// slots (concurrency, throttle) by the key, a budget by its day.
function waitingText(w) {
  const until = w.until ? " until " + when(w.until) : "";
  switch (w.kind) {
    case "concurrency": return "waiting for a slot of key " + w.key;
    case "throttle": return "throttled: key " + w.key + until;
    case "budget": return "budget spent" + until;
    default: return "waiting for " + w.kind + (w.name ? " " + w.name : "") + until;
  }
}

function shownState(state, waiting) {
  return waiting && LIVE.has(state) ? "waiting" : state;
}

function stateCell(row, state, waiting) {
  const shown = shownState(state, waiting);
  const td = cell(row, shown, "state state-" + shown);
  td.dataset.state = shown;
  if (shown === "waiting") td.title = "waiting for " + waiting.kind + " (" + state + ")";
  return td;
}

// An empty table says so, in one cell across its columns.
function emptyRow(tbody, columns, text) {
  if (tbody.children.length > 0) return;
  const tr = document.createElement("tr");
  tr.dataset.empty = "true";
  const td = document.createElement("td");
  td.colSpan = columns;
  td.className = "empty";
  td.textContent = text;
  tr.appendChild(td);
  tbody.appendChild(tr);
}

// What a wait's `until` means, by its kind.
const UNTIL_LABEL = { sleep: "wakes at", signal: "times out at", approval: "times out at", children: "join times out at" };

function when(t) { return t ? new Date(t).toLocaleString() : ""; }

function show(section) {
  for (const id of ["login", "list", "job", "schedules"]) $(id).hidden = id !== section;
  $("signout").hidden = !token();
}

function showLogin() {
  show("login");
  if (refresh) { clearInterval(refresh); refresh = null; }
  $("token").focus();
}

async function loadCounts() {
  const stats = await api("/v1/stats");
  const list = $("counts");
  list.replaceChildren();
  for (const s of STATES) {
    const li = document.createElement("li");
    const a = document.createElement("a");
    a.href = "#/?state=" + s;
    a.textContent = s + " " + (stats.states[s] || 0);
    a.dataset.state = s;
    a.dataset.count = stats.states[s] || 0;
    li.appendChild(a);
    list.appendChild(li);
  }
  // Each token with a daily model-token budget: what it spent today (UTC).
  const budgets = $("budgets");
  budgets.replaceChildren();
  for (const b of stats.budgets || []) {
    const li = document.createElement("li");
    li.dataset.token = b.token;
    li.textContent = `${b.token}: ${b.spent_today} of ${b.daily_budget} model tokens today`;
    if (b.spent_today >= b.daily_budget) li.className = "spent";
    budgets.appendChild(li);
  }
  budgets.hidden = budgets.children.length === 0;
}

async function loadList(cursor) {
  const state = $("state-filter").value;
  const params = new URLSearchParams({ limit: "50" });
  if (state === "waiting") params.set("waiting", "true");
  else if (state === "approval") params.set("waiting", "approval");
  else if (state) params.set("state", state);
  const workflow = $("workflow-filter").value.trim();
  if (workflow) params.set("workflow", workflow);
  // Bulk redrive: the API's, for dead jobs (of this workflow, if one is named).
  $("bulk").hidden = state !== "dead";
  if (cursor) params.set("cursor", cursor);
  const page = await api("/v1/jobs?" + params);
  const needle = $("search").value.trim();
  const rows = $("rows");
  rows.replaceChildren();
  for (const j of page.jobs) {
    if (needle && !j.id.includes(needle)) continue;
    const tr = document.createElement("tr");
    tr.dataset.id = j.id;
    const td = document.createElement("td");
    const a = document.createElement("a");
    a.href = "#/jobs/" + encodeURIComponent(j.id);
    a.textContent = j.id;
    td.appendChild(a);
    td.className = "wrap";
    tr.appendChild(td);
    cell(tr, j.workflow);
    cell(tr, j.token || "—", "wrap").dataset.fact = "token";
    stateCell(tr, j.state, j.waiting);
    cell(tr, j.attempts);
    cell(tr, when(j.created_at));
    const w = j.waiting;
    if (w && w.kind === "approval" && w.tool && LIVE.has(j.state)) {
      // A tool call waiting for a person: what it would do, and the decision.
      const td = cell(tr, "", "wrap approval");
      const what = document.createElement("span");
      what.dataset.fact = "tool-call";
      what.textContent = w.tool.name + " " + JSON.stringify(w.tool.arguments);
      td.appendChild(what);
      for (const approved of [true, false]) {
        const b = document.createElement("button");
        b.type = "button";
        b.className = approved ? "row-approve" : "row-reject";
        b.textContent = approved ? "Approve" : "Reject";
        b.addEventListener("click", async () => {
          b.disabled = true;
          if (await decide(j.id, w, approved, "")) await loadList(cursors[cursors.length - 1] || null);
          b.disabled = false;
        });
        td.appendChild(b);
      }
    } else {
      cell(tr, j.dead_reason || (w && LIVE.has(j.state) ? waitingText(w) : ""), "wrap");
    }
    rows.appendChild(tr);
  }
  nextCursor = page.next_cursor;
  $("next-page").disabled = !nextCursor;
}

async function loadSchedules() {
  const page = await api("/v1/schedules");
  const rows = $("schedule-rows");
  rows.replaceChildren();
  for (const s of page.schedules) {
    const tr = document.createElement("tr");
    tr.dataset.id = s.id;
    cell(tr, s.id, "wrap");
    cell(tr, s.cron);
    cell(tr, s.timezone);
    cell(tr, s.workflow);
    cell(tr, s.catch_up);
    const next = cell(tr, s.paused ? "paused" : when(s.next_fire_at));
    next.dataset.fact = "next-fire";
    // Its newest job, linked (the single view lists its latest ten).
    const latest = cell(tr, "");
    api("/v1/schedules/" + encodeURIComponent(s.id)).then((d) => {
      const j = (d.latest_jobs || [])[0];
      if (!j) return;
      const a = document.createElement("a");
      a.href = "#/jobs/" + encodeURIComponent(j.id);
      a.textContent = j.id + " (" + (j.state || "purged") + ")";
      latest.appendChild(a);
    }).catch(() => {});
    rows.appendChild(tr);
  }
  if (!page.schedules.length) {
    const tr = document.createElement("tr");
    cell(tr, "No schedules yet: POST /v1/schedules, or onceflow schedule create.");
    rows.appendChild(tr);
  }
}

function fact(dl, name, value, href) {
  const dt = document.createElement("dt");
  dt.textContent = name;
  const dd = document.createElement("dd");
  if (href) {
    const a = document.createElement("a");
    a.href = href;
    a.textContent = value;
    a.rel = "noopener";
    dd.appendChild(a);
  } else {
    dd.textContent = value == null ? "—" : String(value);
  }
  dd.dataset.fact = name;
  dl.append(dt, dd);
}

async function loadJob(id) {
  const job = await api("/v1/jobs/" + encodeURIComponent(id));
  $("job-title").textContent = "Job " + job.id;
  const facts = $("job-facts");
  facts.replaceChildren();
  fact(facts, "state", job.waiting && LIVE.has(job.state)
    ? "waiting for " + job.waiting.kind : job.state);
  fact(facts, "workflow", `${job.workflow} v${job.workflow_version}`);
  fact(facts, "attempts", job.attempts);
  fact(facts, "incarnation", job.incarnation);
  const tags = Object.entries(job.tags || {}).map(([k, v]) => k + "=" + v).join(", ");
  fact(facts, "tags", tags || null);
  fact(facts, "dead reason", job.dead_reason);
  if (job.parent) fact(facts, "parent", job.parent, "#/jobs/" + encodeURIComponent(job.parent));
  const waiting = job.waiting;
  fact(facts, "waiting", waiting ? waitingText(waiting) : null);
  if (waiting && waiting.tool) {
    fact(facts, "tool", waiting.tool.name);
    fact(facts, "arguments", JSON.stringify(waiting.tool.arguments));
  }
  // A job scheduled for later looks stuck unless its time is shown.
  // A job whose time has not come is scheduled, not stuck. A waiting job's
  // time is its wait's: when the timer fires, or when the wait times out.
  if (waiting && LIVE.has(job.state)) {
    fact(facts, UNTIL_LABEL[waiting.kind] || "until", when(waiting.until));
  } else if (LIVE.has(job.state)) {
    const later = job.run_at && new Date(job.run_at) > new Date();
    fact(facts, "runs at", when(job.run_at) + (later ? " (scheduled)" : ""));
  }
  // An acked job's last error is history (a failure it recovered from).
  if (job.state !== "acked") {
    fact(facts, "last error", job.last_error ? job.last_error.code + ": " + job.last_error.message : null);
  }
  const template = document.querySelector('meta[name="onceflow-trace-url"]').content;
  const traceHref = job.trace_id && template && template.includes("{trace_id}")
    ? template.replace("{trace_id}", encodeURIComponent(job.trace_id)) : null;
  fact(facts, "trace id", job.trace_id, traceHref);
  fact(facts, "created", when(job.created_at));
  fact(facts, "finished", when(job.finished_at));

  $("job-input").textContent = JSON.stringify(job.input, null, 2);
  const streamed = job.input && job.input.stream === true;
  $("job-output-section").hidden = !streamed;
  const here = location.hash.startsWith("#/jobs/")
    && decodeURIComponent(location.hash.slice("#/jobs/".length)) === job.id;
  if (streamed && here) {
    if (watching && watching.id === job.id && watching.ended && LIVE.has(job.state)) stopWatching();
    watchOutput(job.id);
  } else {
    stopWatching();
  }
  $("job-result").textContent = job.result == null
    ? (LIVE.has(job.state) ? "not yet" : "none") : JSON.stringify(job.result, null, 2);
  const timeline = $("timeline");
  timeline.replaceChildren();
  // The webhook's sends, as one row where they happened: before the job
  // reached `delivered`, or last while it is still sending (or gave up).
  const d = job.delivery;
  const sends = d && d.attempts > 0 ? (() => {
    const tr = document.createElement("tr");
    tr.dataset.kind = "webhook";
    cell(tr, "");
    cell(tr, "webhook " + d.status);
    cell(tr, "");
    cell(tr, d.idempotency_key, "wrap");
    cell(tr, when(d.delivered_at));
    const last = d.last_status == null ? "no answer" : "last answer " + d.last_status;
    cell(tr, `${d.attempts} ${d.attempts === 1 ? "send" : "sends"}, ${last}`
      + (d.last_error ? ` (${d.last_error.code})` : ""), "wrap");
    return tr;
  })() : null;
  let placed = false;
  job.history.forEach((h, i) => {
    if (sends && !placed && h.state === "delivered") { timeline.appendChild(sends); placed = true; }
    const tr = document.createElement("tr");
    cell(tr, i + 1);
    stateCell(tr, h.state);
    cell(tr, h.attempt);
    cell(tr, h.worker, "wrap");
    cell(tr, when(h.at));
    cell(tr, h.note || "", "wrap");
    timeline.appendChild(tr);
  });
  if (sends && !placed) timeline.appendChild(sends);
  const calls = $("model-calls");
  calls.replaceChildren();
  for (const m of job.model_calls || []) {
    const tr = document.createElement("tr");
    cell(tr, m.idempotency_key, "wrap");
    // A call that failed for good keeps its journal row `pending`; once the
    // job is over, it will never be sent again.
    const failed = m.status === "pending" && m.last_error && !LIVE.has(job.state);
    cell(tr, failed ? "failed" : m.status).dataset.status = failed ? "failed" : m.status;
    cell(tr, m.attempts);
    cell(tr, (m.input_tokens ?? "–") + " / " + (m.output_tokens ?? "–"));
    cell(tr, m.last_error ? m.last_error.code : "", "wrap");
    calls.appendChild(tr);
  }
  emptyRow(calls, 5, "No model calls.");
  const tools = $("tool-calls");
  tools.replaceChildren();
  for (const t of job.tool_calls || []) {
    const tr = document.createElement("tr");
    cell(tr, t.turn + "." + t.index);
    cell(tr, t.tool_name);
    cell(tr, t.tool_call_id, "wrap");
    cell(tr, t.status);
    cell(tr, t.attempts);
    tools.appendChild(tr);
  }
  // The call waiting for a person has no ledger row yet: listed all the same.
  if (waiting && waiting.kind === "approval" && waiting.tool && LIVE.has(job.state)
      && !(job.tool_calls || []).some((t) => t.tool_call_id === waiting.tool.tool_call_id)) {
    const tr = document.createElement("tr");
    tr.dataset.waiting = "true";
    cell(tr, "—");
    cell(tr, waiting.tool.name);
    cell(tr, waiting.tool.tool_call_id, "wrap");
    cell(tr, "waiting for approval").dataset.status = "waiting";
    cell(tr, 0);
    tools.appendChild(tr);
  }
  emptyRow(tools, 5, "No tool calls.");
  const children = $("children");
  children.replaceChildren();
  for (const c of job.children || []) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    const a = document.createElement("a");
    a.href = "#/jobs/" + encodeURIComponent(c.id);
    a.textContent = c.id;
    td.appendChild(a);
    td.className = "wrap";
    tr.appendChild(td);
    cell(tr, c.workflow);
    stateCell(tr, c.state);
    children.appendChild(tr);
  }
  emptyRow(children, 3, "No child jobs.");
  const delivery = $("delivery");
  delivery.replaceChildren();
  if (job.delivery) {
    fact(delivery, "key", job.delivery.idempotency_key);
    fact(delivery, "status", job.delivery.status);
    fact(delivery, "sends", job.delivery.attempts);
    fact(delivery, "last status code", job.delivery.last_status);
    fact(delivery, "last error", job.delivery.last_error ? job.delivery.last_error.code : null);
    fact(delivery, "delivered", when(job.delivery.delivered_at));
  } else {
    fact(delivery, "status", LIVE.has(job.state)
      ? "not claimed yet"
      : "none: the job ended before its webhook was claimed");
  }
  $("redrive").hidden = job.state !== "dead";
  $("cancel").hidden = !LIVE.has(job.state);
  $("redrive").dataset.id = job.id;
  $("cancel").dataset.id = job.id;
  const approval = waiting && waiting.kind === "approval" && LIVE.has(job.state);
  for (const b of ["approve", "reject"]) {
    $(b).hidden = !approval;
    $(b).dataset.id = job.id;
    $(b).dataset.waiting = approval ? JSON.stringify(waiting) : "";
  }
  // A reason box only beside a button that takes it.
  const acts = ["redrive", "cancel", "approve", "reject"].some((b) => !$(b).hidden);
  $("reason").hidden = !acts;
  document.querySelector('label[for="reason"]').hidden = !acts;
}

// Every dead job of the filter's workflow (or all, for an empty filter),
// through the API's bulk redrive; jobs whose webhook outcome is unknown are
// skipped, as the API does without confirm_unknown.
async function redriveDead() {
  const workflow = $("workflow-filter").value.trim();
  const reason = $("bulk-reason").value.trim() || "bulk redrive from the console";
  try {
    const body = workflow ? { reason, workflow } : { reason };
    const answer = await api("/v1/jobs/redrive", { method: "POST", body: JSON.stringify(body) });
    say(`Redrove ${answer.redriven} dead jobs (${answer.skipped_unknown} skipped: unknown delivery).`);
    cursors = [];
    await loadList(null);
    await loadCounts();
  } catch (e) {
    if (e.message !== "unauthorized") say("the redrive failed: " + e.message);
  }
}

// A person's decision on a waiting tool call: the signal its wait asks for,
// under an id of that wait (its due time), so a second click is the same
// signal and a changed mind is refused as a conflict; and sent for that
// wait (`until`), so a page shown before the wait was over decides nothing
// (409 not_waiting) rather than a later wait of the same name. Returns
// whether the server took it.
async function decide(id, waiting, approved, note) {
  const payload = note ? { approved, note } : { approved };
  const signalId = "console-" + ((waiting.until || "").replace(/[^0-9]/g, "") || "0");
  try {
    await api("/v1/jobs/" + encodeURIComponent(id) + "/signals/" + encodeURIComponent(waiting.name), {
      method: "POST",
      body: JSON.stringify({ id: signalId, payload, until: waiting.until }),
    });
    say((approved ? "Approved " : "Rejected ") + waiting.name + " of " + id + ".");
    return true;
  } catch (e) {
    if (e.message !== "unauthorized") say("the decision failed: " + e.message);
    return false;
  }
}

// The job page's Approve / Reject, with the reason field as the note.
async function decideHere(approved) {
  const button = $(approved ? "approve" : "reject");
  const id = button.dataset.id;
  const waiting = JSON.parse(button.dataset.waiting || "null");
  if (!waiting) return;
  if (await decide(id, waiting, approved, $("reason").value.trim())) await loadJob(id);
}

async function act(kind) {
  const id = $(kind).dataset.id;
  const reason = $("reason").value.trim() || kind + " from the console";
  try {
    let path = "/v1/jobs/" + encodeURIComponent(id) + "/" + kind;
    let answer;
    try {
      answer = await api(path, { method: "POST", body: JSON.stringify({ reason }) });
    } catch (e) {
      if (kind === "redrive" && /confirm_unknown/.test(e.message)
          && window.confirm(e.message + "\n\nSend it again under the same webhook-id?")) {
        answer = await api(path + "?confirm_unknown=true", { method: "POST", body: JSON.stringify({ reason }) });
      } else {
        throw e;
      }
    }
    say("Job " + id + " is " + answer.state + ".");
    await loadJob(id);
  } catch (e) {
    if (e.message !== "unauthorized") say(kind + " failed: " + e.message);
  }
}

async function route() {
  if (refresh) { clearInterval(refresh); refresh = null; }
  stopWatching();
  const hash = location.hash || "#/";
  try {
    await loadCounts();
    if (hash.startsWith("#/schedules")) {
      show("schedules");
      await loadSchedules();
      refresh = setInterval(() => { loadSchedules().catch(() => {}); }, 5000);
    } else if (hash.startsWith("#/jobs/")) {
      const id = decodeURIComponent(hash.slice("#/jobs/".length));
      show("job");
      await loadJob(id);
      refresh = setInterval(() => { loadJob(id).catch(() => {}); loadCounts().catch(() => {}); }, 1500);
    } else {
      const query = new URLSearchParams(hash.split("?")[1] || "");
      if (query.has("state")) $("state-filter").value = query.get("state");
      show("list");
      cursors = [];
      await loadList(null);
      refresh = setInterval(() => {
        loadList(cursors[cursors.length - 1] || null).catch(() => {});
        loadCounts().catch(() => {});
      }, 2000);
    }
    say("");
  } catch (e) {
    if (e.message !== "unauthorized") say(e.message);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("onceflow-token", $("token").value.trim());
    $("token").value = "";
    route();
  });
  $("signout").addEventListener("click", () => { sessionStorage.removeItem("onceflow-token"); showLogin(); });
  $("filters").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const needle = $("search").value.trim();
    // An exact id opens its page; anything else filters the list.
    if (needle && !/[^A-Za-z0-9_.:-]/.test(needle)) {
      try {
        await api("/v1/jobs/" + encodeURIComponent(needle));
        location.hash = "#/jobs/" + encodeURIComponent(needle);
        return;
      } catch (e) { /* not an id: filter instead */ }
    }
    cursors = [];
    loadList(null).catch((e) => say(e.message));
  });
  $("state-filter").addEventListener("change", () => { cursors = []; loadList(null).catch((e) => say(e.message)); });
  $("next-page").addEventListener("click", () => { cursors.push(nextCursor); loadList(nextCursor).catch((e) => say(e.message)); });
  $("first-page").addEventListener("click", () => { cursors = []; loadList(null).catch((e) => say(e.message)); });
  $("redrive").addEventListener("click", () => act("redrive"));
  $("redrive-dead").addEventListener("click", () => redriveDead());
  $("cancel").addEventListener("click", () => act("cancel"));
  $("approve").addEventListener("click", () => decideHere(true));
  $("reject").addEventListener("click", () => decideHere(false));
  window.addEventListener("hashchange", route);
  route();
});
