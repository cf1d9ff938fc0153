/*
 * wq dashboard. Plain JavaScript, no build step: served by the broker at /ui with the page and
 * uPlot (vendor/). Everything it shows comes from the broker's JSON API, read from the browser:
 * GET /stats (polled; the page keeps the last minutes of samples for the charts and the rates),
 * GET /queues, GET /dlq, GET /jobs/{id}, GET /jobs (a queue's tasks in one state, a page at a
 * time, by cursor), and the admin calls (pause, resume, requeue, purge, cancel, empty, delete).
 * Results and workflows (docs/design/results.md): the gauges waiting and succeeded, those two
 * states in the tasks view, and a task's result, parents and children on its page.
 * Schedules and limits (docs/design/schedules.md): GET /schedules on the Schedules page (next
 * and last fires, the last task, pause and resume), each queue's limits on the Queues page
 * (rate, tokens now, concurrency in use of the limit), and on a task's page the schedule that
 * fired it and for which time.
 *
 * Tokens: a call answered 401 opens the token form (once, however many calls are waiting);
 * the token is kept in sessionStorage and sent as "Authorization: Bearer ..." with every call.
 * A 403 names the scope the call needs. Every error the API answers is shown, never swallowed.
 * No inline script or style (the page is served with a Content-Security-Policy of 'self').
 */
(function () {
  "use strict";

  // Every 2 s, or ?interval=MS (250 ms to a minute): /ui?interval=500#/overview.
  const POLL_MS = Math.min(60000, Math.max(250, Number(new URLSearchParams(location.search).get("interval")) || 2000));
  const HISTORY_S = 300;
  const MIN_SPAN_S = Math.max(5, (10 * POLL_MS) / 1000);
  // The rates shown in figures: over the last five polls, between 2 and 10 seconds.
  const RATE_WINDOW_S = Math.min(10, Math.max(2, (5 * POLL_MS) / 1000));
  const DLQ_LIMIT = 500;
  const TASKS_LIMIT = 50; // a page of a queue's tasks
  const TOKEN_KEY = "wq.token";

  const STATES = ["ready", "handed_out", "delayed", "dead"];
  // Those of results and workflows: waiting for parents (in the invariant beside the four), and
  // succeeded (acked with a result that is kept: results held).
  const RESULT_STATES = ["waiting", "succeeded"];
  const LIST_STATES = [...STATES, ...RESULT_STATES];
  const PENDING = [...STATES, "waiting"]; // what a queue's depth bar shows
  const LABELS = {
    ready: "Ready",
    handed_out: "Handed out",
    delayed: "Delayed",
    dead: "Dead",
    waiting: "Waiting",
    succeeded: "Succeeded",
    enqueued: "Enqueued",
    delivered: "Delivered",
    acked: "Acked",
    nacked: "Nacked",
    reclaimed: "Reclaimed",
    retried: "Retried",
    buried: "Buried",
    requeued: "Requeued",
    purged: "Purged",
    cancelled: "Cancelled",
    expired: "Expired",
    failed: "Failed",
  };
  const TOTAL_HINTS = {
    enqueued: "tasks accepted",
    delivered: "hand-outs to workers",
    acked: "done for good",
    nacked: "failures reported",
    reclaimed: "leases that ran out",
    retried: "sent back for another try",
    buried: "put in the dead-letter queue",
    requeued: "taken back out of it",
    purged: "dropped from it",
    cancelled: "cancelled before they ran",
    expired: "not handed out in time",
  };
  const COLORS = {
    ready: "#15803d",
    handed_out: "#1d4ed8",
    delayed: "#b45309",
    dead: "#b91c1c",
    waiting: "#7c3aed",
    enqueued: "#6d28d9",
    acked: "#15803d",
    failed: "#b91c1c",
  };
  const VIEWS = {
    overview: "Overview",
    queues: "Queues",
    tasks: "Tasks",
    schedules: "Schedules",
    dlq: "Dead letters",
    task: "Task",
  };
  // What the tasks view shows in its "when" column, by state.
  const WHEN = {
    ready: "Ready since",
    delayed: "Due",
    handed_out: "Ready since",
    dead: "Buried",
    waiting: "Enqueued",
    succeeded: "Finished",
  };

  // A JSON value as the page shows it: indented (a value JSON.stringify cannot show, as text).
  function pretty(value, indent) {
    try {
      return JSON.stringify(value, null, indent);
    } catch (e) {
      return String(value);
    }
  }

  // A payload in one short line for a list: a task of the task framework's convention
  // ({"task": name, "args": [...], "kwargs": {...}}, docs/design/tasks.md) as a call, its name
  // apart (shown prominently); anything else as compact JSON. Cut with an ellipsis; the caller
  // puts it in text nodes only (h), so nothing in it is ever read as HTML.
  const PREVIEW_MAX = 80;
  function cut(text, max) {
    const chars = Array.from(text.replace(/\s+/g, " "));
    return chars.length > max ? `${chars.slice(0, max - 1).join("")}\u2026` : chars.join("");
  }
  function preview(payload) {
    const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
    if (isObject(payload) && typeof payload.task === "string" && payload.task) {
      const args = payload.args === undefined ? [] : payload.args;
      const kwargs = payload.kwargs === undefined ? {} : payload.kwargs;
      if (Array.isArray(args) && isObject(kwargs)) {
        const parts = args.map((a) => pretty(a)).concat(Object.entries(kwargs).map(([k, v]) => `${k}=${pretty(v)}`));
        return {name: cut(payload.task, PREVIEW_MAX), rest: cut(`(${parts.join(", ")})`, PREVIEW_MAX)};
      }
    }
    return {name: null, rest: cut(pretty(payload) || "", PREVIEW_MAX)};
  }
  function previewOf(task) {
    const {name, rest} = preview(task.payload);
    const full = pretty(task.payload);
    return h("div", {class: "payload-preview", title: full}, name && h("strong", {class: "task-name"}, name), rest);
  }

  // A text shown whole (wrapping), with a button that copies it.
  function copyButton(text, what) {
    return h(
      "button",
      {
        type: "button",
        class: "btn btn-small copy",
        title: `Copy the ${what}`,
        "aria-label": `Copy the ${what}`,
        onclick: async () => {
          try {
            await navigator.clipboard.writeText(text);
            toast(`Copied the ${what}.`);
          } catch (e) {
            toast(`Could not copy the ${what}: ${e && e.message ? e.message : e}`);
          }
        },
      },
      "Copy",
    );
  }
  function wholeError(text, cls) {
    return h("div", {class: `${cls} whole`}, h("span", {class: "error-body"}, text), copyButton(text, "error"));
  }

  // When a dead task was buried (null: not known, as for a task buried by an older broker).
  function buriedAt(task) {
    return task.buried_at == null ? null : new Date(task.buried_at);
  }

  function count(row, key) {
    return (row && row[key]) || 0;
  }

  // -- formatting ------------------------------------------------------------------------------

  const intFmt = new Intl.NumberFormat(undefined, {maximumFractionDigits: 0});
  const rateFmt = new Intl.NumberFormat(undefined, {minimumFractionDigits: 1, maximumFractionDigits: 1});
  const compactFmt = new Intl.NumberFormat(undefined, {notation: "compact", maximumFractionDigits: 1});
  const clockFmt = new Intl.DateTimeFormat(undefined, {hour: "2-digit", minute: "2-digit", second: "2-digit"});
  const dateFmt = new Intl.DateTimeFormat(undefined, {dateStyle: "medium", timeStyle: "medium"});

  function now() {
    return Date.now() / 1000;
  }

  function formatInt(n) {
    return typeof n === "number" && isFinite(n) ? intFmt.format(n) : "–";
  }

  function formatRate(r) {
    if (r == null || !isFinite(r)) return "–";
    return Math.abs(r) >= 100 ? intFmt.format(r) : rateFmt.format(r);
  }

  function formatDuration(seconds) {
    const s = Math.abs(seconds);
    if (s < 10) return `${rateFmt.format(s)} s`;
    if (s < 60) return `${Math.round(s)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
    return `${intFmt.format(Math.floor(s / 86400))} d ${Math.round((s % 86400) / 3600)} h`;
  }

  // A whole number of milliseconds in the largest unit that divides it: "5 min", "90 s", "500 ms".
  const UNITS = [
    [86400000, "d"],
    [3600000, "h"],
    [60000, "min"],
    [1000, "s"],
  ];

  function formatMs(ms) {
    for (const [size, unit] of UNITS) {
      if (ms >= size && ms % size === 0) return `${formatInt(ms / size)} ${unit}`;
    }
    return `${formatInt(ms)} ms`;
  }

  // A queue's rate limit: "20/s", "100/min", "5 per 500 ms", with its burst when not the default.
  function formatRateLimit(rate) {
    const per = formatMs(rate.per_ms);
    const text = per.startsWith("1 ") ? `${formatInt(rate.tasks)}/${per.slice(2)}` : `${formatInt(rate.tasks)} per ${per}`;
    return rate.burst != null && rate.burst !== rate.tasks ? `${text} (burst ${formatInt(rate.burst)})` : text;
  }

  // Rate tokens: whole when they are, else to one decimal, down (a token not all there is none).
  function formatTokens(tokens) {
    return Number.isInteger(tokens) ? formatInt(tokens) : rateFmt.format(Math.floor(tokens * 10) / 10);
  }

  function relative(date) {
    const seconds = (date.getTime() - Date.now()) / 1000;
    if (Math.abs(seconds) < 1) return "just now";
    return seconds < 0 ? `${formatDuration(seconds)} ago` : `in ${formatDuration(seconds)}`;
  }

  function label(key) {
    return LABELS[key] || key.replace(/_/g, " ").replace(/^./, (c) => c.toUpperCase());
  }

  // -- the DOM ---------------------------------------------------------------------------------

  function $(selector, root) {
    return (root || document).querySelector(selector);
  }

  // h("a", {href: "#", class: "x", onclick: fn}, "text", child): text is always text, never HTML.
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value == null || value === false) continue;
      if (key === "class") el.className = value;
      else if (key === "dataset") Object.assign(el.dataset, value);
      else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else el.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child == null || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  function toast(message) {
    const el = h("div", {class: "toast", role: "status"}, message);
    $("#toasts").append(el);
    setTimeout(() => el.remove(), 4000);
  }

  // -- the API ---------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, message, method, path) {
      super(message);
      this.status = status;
      this.method = method;
      this.path = path;
    }
  }

  const auth = {declined: false, prompt: null};

  function getToken() {
    try {
      return sessionStorage.getItem(TOKEN_KEY);
    } catch (e) {
      return null;
    }
  }

  function setToken(token) {
    try {
      if (token) sessionStorage.setItem(TOKEN_KEY, token);
      else sessionStorage.removeItem(TOKEN_KEY);
    } catch (e) {
      showError("token", new ApiError(0, `the browser refused to keep the token: ${e.message}`));
    }
  }

  async function readBody(resp) {
    const text = await resp.text();
    if (!text) return null;
    try {
      return JSON.parse(text);
    } catch (e) {
      return text;
    }
  }

  async function api(method, path) {
    // (2xx answers: their JSON body, or null for none; a 202 and a 204 are told apart by it)
    for (;;) {
      const token = getToken();
      const headers = {Accept: "application/json"};
      if (token) headers.Authorization = `Bearer ${token}`;
      let resp;
      try {
        resp = await fetch(path, {method, headers, cache: "no-store", credentials: "omit"});
      } catch (e) {
        throw new ApiError(0, `cannot reach the broker (${e.message})`, method, path);
      }
      const body = await readBody(resp);
      if (resp.ok) return body;
      const message =
        body && typeof body === "object" && typeof body.error === "string"
          ? body.error
          : `${resp.status} ${resp.statusText}`.trim();
      if (resp.status === 401 && !auth.declined && (await askToken(message, token))) continue;
      throw new ApiError(resp.status, message, method, path);
    }
  }

  // One prompt for every call waiting on a token; true when a (new) token is there to retry with.
  function askToken(reason, usedToken) {
    if (getToken() !== usedToken) return Promise.resolve(true);
    if (!auth.prompt) {
      auth.prompt = openTokenDialog(reason).finally(() => {
        auth.prompt = null;
      });
    }
    return auth.prompt;
  }

  function openTokenDialog(reason) {
    const dialog = $("#token-dialog");
    const input = $("#token-input");
    $("#token-title").textContent = reason ? "This broker needs a token" : "Bearer token";
    $("#token-reason").textContent = reason ? `The broker answered: ${reason}` : "";
    $("#token-forget").hidden = !getToken();
    input.value = "";
    return new Promise((resolve) => {
      dialog.addEventListener(
        "close",
        () => {
          const value = input.value.trim();
          input.value = "";
          if (dialog.returnValue === "ok" && value) {
            setToken(value);
            auth.declined = false;
            clearError("auth");
            resolve(true);
          } else if (dialog.returnValue === "forget") {
            setToken(null);
            auth.declined = false;
            resolve(true);
          } else {
            if (reason) auth.declined = true;
            resolve(false);
          }
        },
        {once: true},
      );
      dialog.returnValue = "";
      dialog.showModal();
      input.focus();
    });
  }

  // The header's Token button, and the buttons of the 401 and 403 alerts.
  async function changeToken() {
    if (auth.prompt) return;
    auth.prompt = openTokenDialog("");
    let changed;
    try {
      changed = await auth.prompt;
    } finally {
      auth.prompt = null;
    }
    if (changed) {
      clearError("poll");
      clearError("view");
      clearError("action");
      await refreshNow();
    }
  }

  // -- errors ----------------------------------------------------------------------------------

  function describe(err, doing) {
    if (!(err instanceof ApiError)) {
      return {title: `${doing} failed`, detail: String((err && err.message) || err)};
    }
    const call = err.method ? `${err.method} ${err.path}: ` : "";
    if (err.status === 403) {
      // (the broker's message names the route and the scope, or the scopes any of which will do)
      const scope = /with the (.+?) scope/.exec(err.message);
      return {
        title: scope
          ? `Not allowed: ${doing} needs a token with the “${scope[1]}” scope`
          : `Not allowed: ${doing}`,
        detail: `The broker answered 403: ${err.message}`,
        action: "Use another token",
      };
    }
    if (err.status === 401) {
      return {title: "This broker needs a token", detail: call + err.message, action: "Enter token"};
    }
    if (err.status === 0) return {title: "Cannot reach the broker", detail: err.message};
    return {title: `${doing} failed (${err.status})`, detail: call + err.message};
  }

  function showError(key, err, doing) {
    const info = describe(err, doing || "The request");
    const status = err instanceof ApiError ? String(err.status) : "";
    const alert = h(
      "div",
      {class: "alert", role: "alert", id: `alert-${key}`, dataset: {status}},
      h("div", {class: "alert-body"}, h("div", {class: "alert-title"}, info.title), h("div", {}, info.detail)),
      info.action && h("button", {type: "button", class: "btn btn-small", onclick: changeToken}, info.action),
      h(
        "button",
        {type: "button", class: "btn btn-small btn-ghost", "aria-label": "Dismiss", onclick: () => clearError(key)},
        "✕",
      ),
    );
    const old = document.getElementById(`alert-${key}`);
    if (old) old.replaceWith(alert);
    else $("#alerts").append(alert);
  }

  function clearError(key) {
    const old = document.getElementById(`alert-${key}`);
    if (old) old.remove();
  }

  function setStatus(kind, text) {
    const dot = $("#status-dot");
    dot.className = `status-dot ${kind}`;
    $("#status-text").textContent = text;
  }

  // -- state and polling -----------------------------------------------------------------------

  const state = {
    view: "overview",
    live: true,
    timer: null,
    ticking: null,
    stats: null,
    samples: [], // {t: seconds, gauges and totals}
    queues: null,
    queuesKey: "",
    dlq: null,
    dlqKey: "",
    dlqQueue: "",
    tasks: null, // the page shown: {tasks, next_cursor}
    tasksKey: "",
    tasksQueue: "default",
    tasksState: "ready",
    tasksCursors: [""], // the cursor of each page up to the one shown (paging back)
    schedules: null, // GET /schedules's list
    schedulesKey: "",
    schedulesFocus: "", // the schedule a link named (#/schedules?name=...), shown highlighted
    task: null, // {id, found: task | null, key}
    charts: null,
  };

  function record(stats) {
    const t = Date.now() / 1000;
    const last = state.samples[state.samples.length - 1];
    if (last && Object.keys(stats.totals).some((k) => stats.totals[k] < (last.stats.totals[k] || 0))) {
      state.samples = []; // a counter went down: another broker, or this one restarted
    }
    state.samples.push({t, stats});
    while (state.samples.length && state.samples[0].t < t - HISTORY_S) state.samples.shift();
  }

  function failed(totals) {
    return (totals.nacked || 0) + (totals.reclaimed || 0);
  }

  function totalOf(sample, key) {
    return key === "failed" ? failed(sample.stats.totals) : sample.stats.totals[key] || 0;
  }

  // Per second over the last RATE_WINDOW_S seconds of samples (null until there are two).
  function rate(key) {
    const n = state.samples.length;
    if (n < 2) return null;
    const last = state.samples[n - 1];
    let first = state.samples[n - 2];
    for (let i = n - 2; i >= 0 && state.samples[i].t >= last.t - RATE_WINDOW_S; i--) first = state.samples[i];
    const dt = last.t - first.t;
    return dt > 0 ? (totalOf(last, key) - totalOf(first, key)) / dt : null;
  }

  async function tick() {
    if (state.ticking) return state.ticking;
    state.ticking = (async () => {
      try {
        const stats = await api("GET", "/stats");
        clearError("poll");
        state.stats = stats;
        record(stats);
        renderStats();
        setStatus(state.live ? "live" : "paused", `${state.live ? "Live" : "Paused"} · ${clockFmt.format(new Date())}`);
      } catch (e) {
        showError("poll", e, "Reading the broker's stats");
        const text = {401: "Needs a token", 403: "Not allowed", 0: "Disconnected"}[e.status] || "Error";
        setStatus("down", text);
      }
      await refreshView();
    })();
    try {
      await state.ticking;
    } finally {
      state.ticking = null;
    }
  }

  // A tick that starts after now: what an action changed is in what it shows.
  async function refreshNow() {
    if (state.ticking) await state.ticking;
    await tick();
  }

  async function loop() {
    clearTimeout(state.timer);
    await tick();
    if (state.live) state.timer = setTimeout(loop, POLL_MS);
  }

  function setLive(live) {
    state.live = live;
    const button = $("#live-toggle");
    button.setAttribute("aria-pressed", String(live));
    button.textContent = live ? "Pause updates" : "Resume updates";
    clearTimeout(state.timer);
    if (live) loop();
    else setStatus("paused", "Updates paused");
  }

  async function refreshView() {
    try {
      if (state.view === "queues") await loadQueues();
      else if (state.view === "tasks") await loadTasks();
      else if (state.view === "schedules") await loadSchedules();
      else if (state.view === "dlq") await loadDlq();
      else if (state.view === "task" && state.task && state.task.found) await loadTask(state.task.id);
      clearError("view");
    } catch (e) {
      showError("view", e, `Reading ${VIEWS[state.view].toLowerCase()}`);
    }
  }

  // -- overview --------------------------------------------------------------------------------

  function renderStats() {
    const stats = state.stats;
    if (!stats) return;
    for (const key of LIST_STATES) {
      const el = $(`#gauge-${key} .gauge-value`);
      el.textContent = formatInt(stats[key]); // ("–" from a broker that has no such gauge)
      el.dataset.value = stats[key] === undefined ? "" : String(stats[key]);
      el.classList.toggle("nonzero", stats[key] > 0);
    }
    $("#dead-count").textContent = stats.dead > 0 ? formatInt(stats.dead) : "";
    for (const key of ["enqueued", "delivered", "acked", "failed"]) {
      const r = rate(key);
      const el = $(`#rate-${key} .num`);
      el.textContent = formatRate(r);
      el.dataset.value = r == null ? "" : String(r);
    }
    renderTotals(stats.totals);
    if (state.view === "overview") renderCharts();
  }

  function renderTotals(totals) {
    const list = $("#totals");
    for (const [key, value] of Object.entries(totals)) {
      let dd = list.querySelector(`dd[data-total="${CSS.escape(key)}"]`);
      if (!dd) {
        dd = h("dd", {dataset: {total: key}});
        list.append(
          h("div", {title: TOTAL_HINTS[key] || ""}, h("dt", {}, label(key)), dd, h("div", {class: "hint"}, TOTAL_HINTS[key] || "")),
        );
      }
      dd.textContent = formatInt(value);
      dd.dataset.value = String(value);
    }
  }

  const INTEGER_STEPS = [];
  for (let p = 1; p <= 1e12; p *= 10) INTEGER_STEPS.push(p, 2 * p, 5 * p);

  function makeChart(el, series, format, integers) {
    const yAxis = {
      stroke: "#4b5563",
      grid: {stroke: "#eef1f5"},
      ticks: {stroke: "#e2e6ec"},
      size: 52,
      values: (u, values) => values.map((v) => compactFmt.format(v)),
    };
    if (integers) yAxis.incrs = INTEGER_STEPS;
    const opts = {
      width: Math.max(200, el.clientWidth),
      height: 240,
      cursor: {drag: {x: false, y: false}},
      scales: {
        x: {time: true},
        y: {range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1]},
      },
      axes: [{stroke: "#4b5563", grid: {stroke: "#eef1f5"}, ticks: {stroke: "#e2e6ec"}}, yAxis],
      series: [
        {value: (u, v) => (v == null ? "–" : clockFmt.format(new Date(v * 1000)))},
        ...series.map((key) => ({
          label: label(key),
          stroke: COLORS[key],
          width: 2,
          points: {show: false},
          value: (u, v) => (v == null ? "–" : format(v)),
        })),
      ],
    };
    // With the pointer off the chart, the legend shows the latest figures.
    opts.hooks = {
      draw: [
        (u) => {
          if (u.cursor.left < 0 && u.data[0].length) u.setLegend({idx: u.data[0].length - 1});
        },
      ],
    };
    return new uPlot(opts, [[], ...series.map(() => [])], el);
  }

  function ensureCharts() {
    if (state.charts || typeof uPlot === "undefined") return state.charts;
    const gaugesEl = $("#chart-gauges");
    const ratesEl = $("#chart-rates");
    if (!gaugesEl.clientWidth) return null;
    state.charts = {
      gauges: makeChart(gaugesEl, PENDING, formatInt, true),
      rates: makeChart(ratesEl, ["enqueued", "acked", "failed"], (v) => `${formatRate(v)}/s`, false),
    };
    const observer = new ResizeObserver(() => {
      for (const [chart, el] of [[state.charts.gauges, gaugesEl], [state.charts.rates, ratesEl]]) {
        if (el.clientWidth) chart.setSize({width: el.clientWidth, height: 240});
      }
    });
    observer.observe(gaugesEl);
    observer.observe(ratesEl);
    return state.charts;
  }

  function renderCharts() {
    const charts = ensureCharts();
    if (!charts) return;
    const samples = state.samples;
    const times = samples.map((s) => s.t);
    const gauges = PENDING.map((k) => samples.map((s) => (s.stats[k] === undefined ? null : s.stats[k])));
    charts.gauges.setData(padded([times, ...gauges]));
    // Each point: the rate over the samples of the last couple of seconds (one poll is noisy).
    const window = Math.max(2, (3 * POLL_MS) / 1000);
    const since = [];
    for (let i = 0, j = 0; i < samples.length; i++) {
      while (samples[j].t < samples[i].t - window) j++;
      since.push(j < i ? j : i > 0 ? i - 1 : null);
    }
    const rates = ["enqueued", "acked", "failed"].map((key) =>
      samples.map((s, i) => {
        const j = since[i];
        if (j == null) return null;
        const dt = s.t - samples[j].t;
        return dt > 0 ? (totalOf(s, key) - totalOf(samples[j], key)) / dt : null;
      }),
    );
    charts.rates.setData(padded([times, ...rates]));
  }

  // At least ten polls' worth of time on the x axis, from the start: a lone sample is no range.
  function padded(data) {
    const times = data[0];
    const last = times.length ? times[times.length - 1] : now();
    if (times.length && last - times[0] >= MIN_SPAN_S) return data;
    return [[last - MIN_SPAN_S, ...times], ...data.slice(1).map((values) => [null, ...values])];
  }

  // -- queues ----------------------------------------------------------------------------------

  async function loadQueues() {
    const rows = await api("GET", "/queues");
    state.queues = rows;
    fillQueueFilter();
    const key = JSON.stringify(rows);
    if (key !== state.queuesKey) {
      state.queuesKey = key;
      renderQueues();
    }
  }

  function oldestReady(row) {
    if (typeof row.oldest_ready_age === "number") return row.oldest_ready_age;
    if (typeof row.oldest_ready_at === "string") return (Date.now() - Date.parse(row.oldest_ready_at)) / 1000;
    return undefined;
  }

  function renderQueues() {
    const rows = state.queues || [];
    const withAge = rows.some((r) => r.oldest_ready_age !== undefined || r.oldest_ready_at !== undefined);
    $("#queues-table .col-oldest").hidden = !withAge;
    // The gauges of results and workflows, once some queue has any.
    const withResults = rows.some((r) => count(r, "waiting") || count(r, "succeeded"));
    for (const th of document.querySelectorAll("#queues-table .col-results")) th.hidden = !withResults;
    // Their limits (rate, tokens now, concurrency in use of the limit), once some queue has any.
    const withLimits = rows.some((r) => r.limits != null);
    for (const th of document.querySelectorAll("#queues-table .col-limits")) th.hidden = !withLimits;
    const deepest = Math.max(1, ...rows.map((r) => PENDING.reduce((n, k) => n + count(r, k), 0)));
    const tbody = $("#queues-table tbody");
    tbody.replaceChildren(
      ...rows.map((row) => {
        const bar = h("div", {class: "bar", title: PENDING.map((k) => `${label(k)}: ${formatInt(count(row, k))}`).join(", ")});
        for (const k of PENDING) {
          if (!row[k]) continue;
          const part = h("span", {class: k});
          part.style.width = `${(100 * row[k]) / deepest}%`;
          bar.append(part);
        }
        const age = oldestReady(row);
        const cell = (key) => {
          const value = count(row, key);
          const td = h("td", {class: "num", "data-label": label(key), dataset: {field: key, value}}, formatInt(value));
          if (value > 0) td.replaceChildren(h("a", {href: tasksHash(row.name, key)}, formatInt(value)));
          return td;
        };
        const dead = cell("dead");
        if (row.dead > 0) {
          dead.replaceChildren(h("a", {href: `#/dlq?queue=${encodeURIComponent(row.name)}`}, formatInt(row.dead)));
        }
        return h(
          "tr",
          {dataset: {queue: row.name}},
          h("td", {"data-label": "Queue"}, h("a", {class: "queue-name", href: tasksHash(row.name, "ready")}, row.name)),
          cell("ready"),
          cell("handed_out"),
          cell("delayed"),
          dead,
          withResults && cell("waiting"),
          withResults && cell("succeeded"),
          withAge && h("td", {class: "num", "data-label": "Oldest ready"}, age == null ? "–" : formatDuration(age)),
          withLimits && limitCells(row),
          h("td", {class: "col-bar", "data-label": "Depth"}, bar),
          h(
            "td",
            {"data-label": "State"},
            h("span", {class: `badge ${row.paused ? "badge-paused" : "badge-active"}`, dataset: {paused: String(row.paused)}}, row.paused ? "Paused" : "Active"),
          ),
          h(
            "td",
            {class: "actions"},
            h(
              "button",
              {
                type: "button",
                class: `btn btn-small ${row.paused ? "resume" : "pause"}`,
                onclick: (event) => pauseOrResume(event.currentTarget, row.name, !row.paused),
              },
              row.paused ? "Resume" : "Pause",
            ),
          ),
        );
      }),
    );
    $("#queues-empty").hidden = rows.length > 0;
    const paused = rows.filter((r) => r.paused).length;
    $("#queues-summary").textContent = rows.length
      ? `${formatInt(rows.length)} ${rows.length === 1 ? "queue" : "queues"}${paused ? `, ${formatInt(paused)} paused` : ""}`
      : "";
  }

  // A queue's rate limit, its rate tokens now and its concurrency (in use / limit); "–": none.
  function limitCells(row) {
    const limits = row.limits || {};
    const rate = limits.rate || null;
    const concurrency = limits.concurrency == null ? null : limits.concurrency;
    const inUse = count(row, "handed_out");
    return [
      h(
        "td",
        {class: "num limit", "data-label": "Rate limit", dataset: {field: "rate", value: rate ? `${rate.tasks}/${rate.per_ms}` : ""}},
        rate ? formatRateLimit(rate) : "–",
      ),
      h(
        "td",
        {class: "num", "data-label": "Tokens", dataset: {field: "tokens", value: row.tokens == null ? "" : String(row.tokens)}},
        row.tokens == null ? "–" : formatTokens(row.tokens),
      ),
      h(
        "td",
        {
          class: `num limit${concurrency != null && inUse >= concurrency ? " at-limit" : ""}`,
          "data-label": "Concurrency",
          dataset: {field: "concurrency", value: concurrency == null ? "" : `${inUse}/${concurrency}`},
        },
        concurrency == null ? "–" : `${formatInt(inUse)} / ${formatInt(concurrency)}`,
      ),
    ];
  }

  async function pauseOrResume(button, name, pause) {
    const verb = pause ? "pause" : "resume";
    button.disabled = true;
    try {
      await api("POST", `/queues/${encodeURIComponent(name)}/${verb}`);
      clearError("action");
      toast(pause ? `Paused ${name}: its tasks stay ready, none is handed out` : `Resumed ${name}`);
    } catch (e) {
      showError("action", e, `${pause ? "Pausing" : "Resuming"} queue ${name}`);
    } finally {
      button.disabled = false;
    }
    await refreshNow();
  }

  // -- a queue's tasks -------------------------------------------------------------------------

  function tasksHash(queue, taskState) {
    const query = new URLSearchParams({queue, state: taskState});
    return `#/tasks?${query}`;
  }

  function queueRow(name) {
    return (state.queues || []).find((q) => q.name === name) || null;
  }

  async function loadTasks() {
    const cursor = state.tasksCursors[state.tasksCursors.length - 1];
    const query = new URLSearchParams({queue: state.tasksQueue, state: state.tasksState, limit: String(TASKS_LIMIT)});
    if (cursor) query.set("cursor", cursor);
    const [page, queues] = await Promise.all([api("GET", `/jobs?${query}`), api("GET", "/queues")]);
    state.queues = queues;
    fillQueueFilter();
    state.tasks = page;
    const key = JSON.stringify([state.tasksQueue, state.tasksState, state.tasksCursors, page, queueRow(state.tasksQueue)]);
    if (key !== state.tasksKey) {
      state.tasksKey = key;
      renderTasks();
    }
  }

  function renderStates() {
    const row = queueRow(state.tasksQueue);
    $("#tasks-states").replaceChildren(
      ...LIST_STATES.map((k) =>
        h(
          "a",
          {
            class: "segment",
            href: tasksHash(state.tasksQueue, k),
            "aria-current": k === state.tasksState ? "page" : null,
            dataset: {state: k},
          },
          label(k),
          h("span", {class: "count"}, formatInt(count(row, k))),
        ),
      ),
    );
  }

  function detail(task) {
    const parts = [];
    if (task.cancelling) parts.push(h("span", {class: "badge badge-cancelling"}, "Cancelling"));
    if (task.state === "waiting" && task.after) {
      const text = `waiting for ${formatInt(task.waiting_for || 0)} of ${formatInt(task.after.length)} ${task.after.length === 1 ? "parent" : "parents"}`;
      parts.push(h("div", {class: "detail-text waiting"}, text));
    }
    if (task.state === "succeeded") {
      const text = "result" in task ? `result ${pretty(task.result)}` : "no result";
      parts.push(h("div", {class: "detail-text result", title: text}, text));
    }
    if (task.progress !== undefined) {
      const text = JSON.stringify(task.progress);
      parts.push(h("div", {class: "detail-text progress", title: text}, `progress ${text}`));
    } else if (task.last_error != null && task.state !== "ready") {
      parts.push(wholeError(task.last_error, "detail-text error"));
    }
    if (task.expires_at && task.state !== "handed_out" && task.state !== "dead") {
      parts.push(h("div", {class: "hint"}, `expires ${relative(new Date(task.expires_at))}`));
    }
    return parts.length ? parts : "–";
  }

  function renderTasks() {
    const page = state.tasks || {tasks: [], next_cursor: null};
    const tasks = page.tasks;
    const row = queueRow(state.tasksQueue);
    const number = state.tasksCursors.length;
    renderStates();
    $("#tasks-when").textContent = WHEN[state.tasksState];
    $("#tasks-detail").textContent = state.tasksState === "handed_out" ? "Progress" : "Details";
    const total = count(row, state.tasksState);
    const what = `${label(state.tasksState).toLowerCase()} ${total === 1 ? "task" : "tasks"} in ${state.tasksQueue}`;
    $("#tasks-summary").textContent = tasks.length
      ? `${formatInt(total)} ${what}; page ${formatInt(number)}: ${formatInt(tasks.length)} of them.`
      : "";
    $("#tasks-none").hidden = tasks.length > 0;
    $("#tasks-none").textContent = number > 1 ? "No more tasks on this page." : `No ${label(state.tasksState).toLowerCase()} tasks in ${state.tasksQueue}.`;
    $("#tasks-page").textContent = `Page ${formatInt(number)}`;
    $("#tasks-first").disabled = number === 1;
    $("#tasks-prev").disabled = number === 1;
    $("#tasks-next").disabled = !page.next_cursor;
    const empty = row && PENDING.reduce((n, k) => n + count(row, k), 0) === 0;
    $("#tasks-delete-queue").hidden = !empty;
    $("#tasks-empty-queue").disabled = !row || row.ready + row.delayed + count(row, "waiting") === 0;
    $("#tasks-table tbody").replaceChildren(
      ...tasks.map((task) => {
        const created = new Date(task.created_at);
        const dead = task.state === "dead";
        const since = dead ? buriedAt(task) : new Date(task.state === "succeeded" && task.finished_at ? task.finished_at : task.available_at);
        const done = task.state === "succeeded"; // (its result is kept: nothing to cancel)
        return h(
          "tr",
          {dataset: {id: task.id, state: task.state}},
          h("td", {"data-label": "Task"}, h("a", {class: "mono", href: `#/task/${encodeURIComponent(task.id)}`}, task.id), previewOf(task)),
          h("td", {class: "num", "data-label": "Priority"}, String(task.priority)),
          h("td", {class: "num", "data-label": "Attempts"}, `${formatInt(task.attempts)} / ${formatInt(task.max_attempts)}`),
          h("td", {"data-label": "Created", title: dateFmt.format(created)}, relative(created)),
          h(
            "td",
            {"data-label": WHEN[task.state], class: "when", title: since ? dateFmt.format(since) : "not known (buried by an older broker)"},
            since ? relative(since) : "unknown",
          ),
          h("td", {"data-label": state.tasksState === "handed_out" ? "Progress" : "Details"}, detail(task)),
          h(
            "td",
            {class: "actions"},
            task.cancelling || done
              ? null
              : h(
                  "button",
                  {type: "button", class: "btn btn-small btn-danger cancel", onclick: () => cancelOne(task)},
                  dead ? "Purge" : "Cancel",
                ),
          ),
        );
      }),
    );
  }

  function pageTo(cursors) {
    state.tasksCursors = cursors;
    state.tasksKey = "";
    refreshView();
  }

  async function cancelOne(task) {
    const where = `Task ${task.id} (queue ${task.queue})`;
    const [title, message, verb] =
      task.state === "dead"
        ? ["Purge this task?", `${where} is dropped for good, with its payload. This cannot be undone.`, "Purge"]
        : task.state === "handed_out"
          ? [
              "Cancel this running task?",
              `A worker holds ${where.charAt(0).toLowerCase()}${where.slice(1)}: it is told to stop, and the task will not be retried (an ack it sends still counts).`,
              "Cancel task",
            ]
          : task.state === "waiting"
            ? [
                "Cancel this task?",
                `${where} is dropped now, with its payload, and never runs; so is every task waiting for it. This cannot be undone.`,
                "Cancel task",
              ]
            : ["Cancel this task?", `${where} is dropped now, with its payload, and never runs. This cannot be undone.`, "Cancel task"];
    const ok = await confirmAction(title, message, verb, true);
    if (!ok) return;
    await act(
      `${task.state === "dead" ? "Purging" : "Cancelling"} task ${task.id}`,
      () => api("DELETE", `/jobs/${encodeURIComponent(task.id)}`),
      (body) =>
        body && body.state === "cancelling"
          ? `Cancelling task ${task.id}: its worker is told, and it will not be retried`
          : `${task.state === "dead" ? "Purged" : "Cancelled"} task ${task.id}`,
    );
  }

  async function emptyQueue() {
    const name = state.tasksQueue;
    const row = queueRow(name);
    const waiting = count(row, "waiting");
    const n = count(row, "ready") + count(row, "delayed") + waiting;
    const which = waiting ? "ready, delayed and waiting" : "ready and delayed";
    const ok = await confirmAction(
      "Empty this queue?",
      `All ${formatInt(n)} ${which} ${n === 1 ? "task" : "tasks"} of queue ${name} are cancelled, with their payloads. Tasks handed out run their course. This cannot be undone.`,
      "Empty queue",
      true,
    );
    if (!ok) return;
    await act(
      `Emptying queue ${name}`,
      () => api("POST", `/queues/${encodeURIComponent(name)}/empty`),
      (body) => `Emptied ${name}: ${formatInt(body && body.cancelled)} ${body && body.cancelled === 1 ? "task" : "tasks"} cancelled`,
    );
  }

  async function deleteQueue() {
    const name = state.tasksQueue;
    const ok = await confirmAction(
      "Delete this queue?",
      `Queue ${name} holds nothing: it is forgotten, with its paused state and its totals. A task sent to it later makes it again.`,
      "Delete queue",
      true,
    );
    if (!ok) return;
    let deleted = false;
    await act(
      `Deleting queue ${name}`,
      async () => {
        await api("DELETE", `/queues/${encodeURIComponent(name)}`);
        deleted = true;
      },
      () => `Deleted queue ${name}`,
    );
    if (deleted) location.hash = "#/queues";
  }

  // -- schedules -------------------------------------------------------------------------------

  async function loadSchedules() {
    const body = await api("GET", "/schedules");
    const rows = (body && body.schedules) || [];
    state.schedules = rows;
    const key = JSON.stringify([rows, state.schedulesFocus]);
    if (key !== state.schedulesKey) {
      state.schedulesKey = key;
      renderSchedules();
    } else {
      refreshScheduleTimes(); // (the same schedules: only "in 3 s" moves on)
    }
  }

  function scheduleRule(schedule) {
    if (schedule.cron != null) {
      return h("span", {}, h("span", {class: "mono"}, schedule.cron), " ", h("span", {class: "hint"}, schedule.timezone || "UTC"));
    }
    return `every ${formatMs(schedule.every_ms)}`;
  }

  // A fire's time in a cell: how far from now (kept up to date), the date on hover.
  function fireCell(label, field, at) {
    return h(
      "td",
      {"data-label": label, class: field, title: at ? dateFmt.format(new Date(at)) : null, dataset: {at: at || ""}},
      at ? relative(new Date(at)) : "–",
    );
  }

  function refreshScheduleTimes() {
    for (const cell of document.querySelectorAll("#schedules-table td.next-fire, #schedules-table td.last-fire")) {
      if (cell.dataset.at) cell.textContent = relative(new Date(cell.dataset.at));
    }
  }

  function renderSchedules() {
    const rows = state.schedules || [];
    const paused = rows.filter((s) => s.paused).length;
    $("#schedules-summary").textContent = rows.length
      ? `${formatInt(rows.length)} ${rows.length === 1 ? "schedule" : "schedules"}${paused ? `, ${formatInt(paused)} paused` : ""}`
      : "";
    $("#schedules-empty").hidden = rows.length > 0;
    $("#schedules-table tbody").replaceChildren(
      ...rows.map((schedule) =>
        h(
          "tr",
          {
            class: schedule.name === state.schedulesFocus ? "focus" : null,
            dataset: {schedule: schedule.name, paused: String(schedule.paused)},
          },
          h("td", {"data-label": "Schedule"}, h("span", {class: "queue-name"}, schedule.name)),
          h("td", {"data-label": "Rule", class: "rule"}, scheduleRule(schedule)),
          h("td", {"data-label": "Queue"}, h("a", {class: "queue-name", href: tasksHash(schedule.queue, "ready")}, schedule.queue)),
          fireCell("Next fire", "next-fire", schedule.paused ? null : schedule.next_fire_at),
          fireCell("Last fire", "last-fire", schedule.last_fire_at),
          h(
            "td",
            {"data-label": "Last task", class: "last-task"},
            schedule.last_task_id
              ? h("a", {class: "mono", href: `#/task/${encodeURIComponent(schedule.last_task_id)}`}, schedule.last_task_id)
              : "–",
          ),
          h("td", {class: "num", "data-label": "Fires", dataset: {field: "fires", value: String(schedule.fires)}}, formatInt(schedule.fires)),
          h(
            "td",
            {"data-label": "State"},
            h("span", {class: `badge ${schedule.paused ? "badge-paused" : "badge-active"}`}, schedule.paused ? "Paused" : "Active"),
          ),
          h(
            "td",
            {class: "actions"},
            h(
              "button",
              {
                type: "button",
                class: `btn btn-small ${schedule.paused ? "resume" : "pause"}`,
                onclick: (event) => pauseOrResumeSchedule(event.currentTarget, schedule.name, !schedule.paused),
              },
              schedule.paused ? "Resume" : "Pause",
            ),
          ),
        ),
      ),
    );
  }

  async function pauseOrResumeSchedule(button, name, pause) {
    button.disabled = true;
    try {
      const schedule = await api("POST", `/schedules/${encodeURIComponent(name)}/${pause ? "pause" : "resume"}`);
      clearError("action");
      const next = schedule && schedule.next_fire_at ? `: next fire ${relative(new Date(schedule.next_fire_at))}` : "";
      toast(pause ? `Paused schedule ${name}: no fires until it is resumed` : `Resumed schedule ${name}${next}`);
    } catch (e) {
      showError("action", e, `${pause ? "Pausing" : "Resuming"} schedule ${name}`);
    } finally {
      button.disabled = false;
    }
    state.schedulesKey = "";
    await refreshNow();
  }

  // -- dead letters ----------------------------------------------------------------------------

  function fillQueueFilter() {
    const select = $("#dlq-queue");
    const names = (state.queues || []).map((q) => q.name);
    if (state.dlqQueue && !names.includes(state.dlqQueue)) names.push(state.dlqQueue);
    const have = Array.from(select.options).slice(1).map((o) => o.value);
    if (have.join("\n") !== names.join("\n")) {
      select.replaceChildren(h("option", {value: ""}, "All queues"), ...names.map((n) => h("option", {value: n}, n)));
    }
    select.value = state.dlqQueue;
    fillTasksQueue();
  }

  function fillTasksQueue() {
    const select = $("#tasks-queue");
    const names = (state.queues || []).map((q) => q.name);
    if (!names.includes(state.tasksQueue)) names.push(state.tasksQueue);
    const have = Array.from(select.options).map((o) => o.value);
    if (have.join("\n") !== names.join("\n")) {
      select.replaceChildren(...names.map((n) => h("option", {value: n}, n)));
    }
    select.value = state.tasksQueue;
  }

  function deadCount() {
    if (!state.dlqQueue) return state.stats ? state.stats.dead : null;
    const row = (state.queues || []).find((q) => q.name === state.dlqQueue);
    return row ? row.dead : null;
  }

  async function loadDlq() {
    const query = new URLSearchParams({limit: String(DLQ_LIMIT)});
    if (state.dlqQueue) query.set("queue", state.dlqQueue);
    const [tasks, queues] = await Promise.all([api("GET", `/dlq?${query}`), api("GET", "/queues")]);
    state.queues = queues;
    fillQueueFilter();
    state.dlq = tasks;
    const key = JSON.stringify([tasks, deadCount()]);
    if (key !== state.dlqKey) {
      state.dlqKey = key;
      renderDlq();
    }
  }

  function renderDlq() {
    const tasks = state.dlq || [];
    const total = Math.max(deadCount() || 0, tasks.length);
    const where = state.dlqQueue ? ` in ${state.dlqQueue}` : "";
    $("#dlq-summary").textContent = total
      ? tasks.length < total
        ? `Showing the first ${formatInt(tasks.length)} of ${formatInt(total)} dead tasks${where}, oldest burial first.`
        : `${formatInt(total)} dead ${total === 1 ? "task" : "tasks"}${where}, oldest burial first.`
      : "";
    const all = $("#dlq-requeue-all");
    all.disabled = total === 0;
    all.textContent = total ? `Requeue all (${formatInt(total)})` : "Requeue all";
    $("#dlq-empty").hidden = tasks.length > 0;
    $("#dlq-empty").textContent = state.dlqQueue
      ? `No dead tasks in ${state.dlqQueue}.`
      : "The dead-letter queue is empty. Nothing has failed for good.";
    $("#dlq-table tbody").replaceChildren(
      ...tasks.map((task) => {
        const created = new Date(task.created_at);
        const buried = buriedAt(task);
        return h(
          "tr",
          {dataset: {id: task.id}},
          h("td", {"data-label": "Task"}, h("a", {class: "mono", href: `#/task/${encodeURIComponent(task.id)}`}, task.id), previewOf(task)),
          h("td", {"data-label": "Queue"}, h("span", {class: "queue-name"}, task.queue)),
          h("td", {class: "num", "data-label": "Attempts"}, `${formatInt(task.attempts)} / ${formatInt(task.max_attempts)}`),
          h(
            "td",
            {"data-label": "Last error"},
            task.last_error == null ? "–" : wholeError(task.last_error, "error-text"),
          ),
          h(
            "td",
            {"data-label": "Buried", class: "buried", "data-at": task.buried_at, title: buried ? dateFmt.format(buried) : "not known (buried by an older broker)"},
            buried ? relative(buried) : "unknown",
            h("div", {class: "hint", title: dateFmt.format(created)}, `created ${relative(created)}`),
          ),
          h(
            "td",
            {class: "actions"},
            h("button", {type: "button", class: "btn btn-small requeue", onclick: () => requeueOne(task)}, "Requeue"),
            h("button", {type: "button", class: "btn btn-small btn-danger purge", onclick: () => purgeOne(task)}, "Purge"),
          ),
        );
      }),
    );
  }

  function confirmAction(title, message, confirmLabel, danger) {
    const dialog = $("#confirm-dialog");
    $("#confirm-title").textContent = title;
    $("#confirm-message").textContent = message;
    const ok = $("#confirm-ok");
    ok.textContent = confirmLabel;
    ok.classList.toggle("btn-danger", !!danger);
    return new Promise((resolve) => {
      dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), {once: true});
      dialog.returnValue = "";
      dialog.showModal();
      $("#confirm-cancel").focus();
    });
  }

  async function act(doing, call, done) {
    try {
      const body = await call();
      clearError("action");
      toast(done(body));
    } catch (e) {
      showError("action", e, doing);
    }
    state.dlqKey = "";
    state.tasksKey = "";
    await refreshNow();
  }

  async function requeueOne(task) {
    const ok = await confirmAction(
      "Requeue this task?",
      `Task ${task.id} (queue ${task.queue}) goes back to ready, with its attempts reset to 0 and its last error cleared.`,
      "Requeue",
      false,
    );
    if (!ok) return;
    await act(
      `Requeueing task ${task.id}`,
      () => api("POST", `/dlq/${encodeURIComponent(task.id)}/requeue`),
      () => `Requeued task ${task.id}`,
    );
  }

  async function purgeOne(task) {
    const ok = await confirmAction(
      "Purge this task?",
      `Task ${task.id} (queue ${task.queue}) is dropped for good, with its payload. This cannot be undone.`,
      "Purge",
      true,
    );
    if (!ok) return;
    await act(
      `Purging task ${task.id}`,
      () => api("DELETE", `/dlq/${encodeURIComponent(task.id)}`),
      () => `Purged task ${task.id}`,
    );
  }

  async function requeueAll() {
    const queue = state.dlqQueue;
    const count = deadCount();
    const what = `${count == null ? "every" : `all ${formatInt(count)}`} dead ${count === 1 ? "task" : "tasks"}${queue ? ` of queue ${queue}` : ""}`;
    const ok = await confirmAction(
      "Requeue all dead tasks?",
      `This puts ${what} back in ready, each with its attempts reset to 0.`,
      "Requeue all",
      false,
    );
    if (!ok) return;
    await act(
      "Requeueing the dead-letter queue",
      () => api("POST", queue ? `/dlq/requeue?queue=${encodeURIComponent(queue)}` : "/dlq/requeue"),
      (body) => `Requeued ${formatInt(body && body.requeued)} ${body && body.requeued === 1 ? "task" : "tasks"}`,
    );
  }

  // -- a task ----------------------------------------------------------------------------------

  async function loadTask(id) {
    let found = null;
    let missing = null;
    try {
      found = await api("GET", `/jobs/${encodeURIComponent(id)}`);
    } catch (e) {
      if (!(e instanceof ApiError) || e.status !== 404) throw e;
      missing = e.message;
    }
    const key = JSON.stringify([id, found, missing]);
    if (state.task && state.task.key === key) return;
    state.task = {id, found, key};
    renderTask(id, found, missing);
  }

  function fact(name, ...value) {
    return h("div", {}, h("dt", {}, name), h("dd", {}, ...value));
  }

  function when(text) {
    const date = new Date(text);
    return [dateFmt.format(date), h("span", {class: "hint"}, relative(date))];
  }

  function renderTask(id, task, missing) {
    const result = $("#task-result");
    if (!task) {
      result.replaceChildren(
        h(
          "div",
          {class: "card", id: "task-missing"},
          h("h2", {}, "No such task"),
          h(
            "p",
            {},
            `No task has the id ${id}. A task acked without a result (or whose result's time ran out), cancelled or purged is gone for good; the id may also be mistyped.`,
          ),
          h("p", {class: "hint"}, `The broker answered 404: ${missing}`),
        ),
      );
      return;
    }
    const payload = pretty(task.payload, 2);
    const dead = task.state === "dead";
    const progress = task.progress !== undefined ? pretty(task.progress, 2) : null;
    const output = "result" in task ? pretty(task.result, 2) : null; // (its result, shown)
    result.replaceChildren(
      h(
        "article",
        {class: "card", id: "task-card", dataset: {id: task.id, state: task.state, cancelling: String(!!task.cancelling)}},
        h(
          "div",
          {class: "task-head"},
          h("h2", {}, task.id),
          h("span", {class: `badge badge-${task.state}`, id: "task-state"}, label(task.state)),
          task.cancelling && h("span", {class: "badge badge-cancelling", id: "task-cancelling"}, "Cancelling"),
          dead
            ? h(
                "div",
                {class: "actions"},
                h("button", {type: "button", class: "btn btn-small requeue", onclick: () => requeueOne(task)}, "Requeue"),
                h("button", {type: "button", class: "btn btn-small btn-danger purge", onclick: () => purgeOne(task)}, "Purge"),
              )
            : !task.cancelling &&
                task.state !== "succeeded" &&
                h(
                  "div",
                  {class: "actions"},
                  h("button", {type: "button", class: "btn btn-small btn-danger cancel", onclick: () => cancelOne(task)}, "Cancel"),
                ),
        ),
        h(
          "dl",
          {class: "facts"},
          fact("Queue", h("a", {href: tasksHash(task.queue, task.state), class: "queue-name"}, task.queue)),
          fact("Priority", String(task.priority)),
          fact("Attempts", h("span", {id: "task-attempts"}, `${formatInt(task.attempts)} of ${formatInt(task.max_attempts)}`)),
          fact("Created", ...when(task.created_at)),
          dead
            ? fact("Buried", ...(task.buried_at == null ? [h("span", {class: "hint", id: "task-buried"}, "unknown (buried by an older broker)")] : [h("span", {id: "task-buried"}, dateFmt.format(new Date(task.buried_at))), h("span", {class: "hint"}, relative(new Date(task.buried_at)))]))
            : task.state !== "succeeded" &&
                fact(
                  task.state === "delayed" ? "Next attempt" : task.state === "waiting" ? "Enqueued" : "Ready since",
                  ...when(task.available_at),
                ),
          task.expires_at && fact("Expires", ...when(task.expires_at)),
          task.timeout_ms !== undefined && fact("Time limit", h("span", {id: "task-timeout"}, formatDuration(task.timeout_ms / 1000))),
          task.state === "waiting" &&
            task.after &&
            fact(
              "Waiting for",
              h("span", {id: "task-waiting-for"}, `${formatInt(task.waiting_for || 0)} of ${formatInt(task.after.length)} ${task.after.length === 1 ? "parent" : "parents"}`),
            ),
          task.finished_at && fact("Finished", h("span", {id: "task-finished"}, dateFmt.format(new Date(task.finished_at))), h("span", {class: "hint"}, relative(new Date(task.finished_at)))),
          task.result_ttl_ms !== undefined && fact("Result kept", h("span", {id: "task-result-ttl"}, formatDuration(task.result_ttl_ms / 1000))),
          task.schedule != null &&
            fact("Schedule", h("a", {id: "task-schedule", href: `#/schedules?name=${encodeURIComponent(task.schedule)}`}, task.schedule)),
          task.scheduled_for != null &&
            fact(
              "Scheduled for",
              h("span", {id: "task-scheduled-for", dataset: {at: task.scheduled_for}}, dateFmt.format(new Date(task.scheduled_for))),
              h("span", {class: "hint"}, relative(new Date(task.scheduled_for))),
            ),
        ),
        task.after && h("div", {class: "section-label"}, `Parents (${formatInt(task.after.length)})`),
        task.after && taskLinks("task-parents", task.after, task.after.length),
        task.children && h("div", {class: "section-label"}, `Children (${formatInt(task.children_count || task.children.length)})`),
        task.children && taskLinks("task-children", task.children, task.children_count || task.children.length),
        output !== null && h("div", {class: "section-label"}, "Result"),
        output !== null && h("pre", {class: "block", id: "task-result-json"}, output),
        task.state === "succeeded" && output === null && h("p", {class: "hint", id: "task-result-json"}, "No result: it was acked without one."),
        progress !== null && h("div", {class: "section-label"}, "Progress"),
        progress !== null && h("pre", {class: "block", id: "task-progress"}, progress),
        h("div", {class: "section-label"}, "Last error"),
        task.last_error == null
          ? h("p", {class: "hint", id: "task-error"}, "None: no attempt has failed.")
          : h("div", {class: "block-wrap"}, h("pre", {class: "block error", id: "task-error"}, task.last_error), copyButton(task.last_error, "error")),
        h("div", {class: "section-label"}, "Payload"),
        h("pre", {class: "block", id: "task-payload"}, payload),
      ),
    );
  }

  // Links to tasks (a task's parents or children), and how many more there are than shown.
  function taskLinks(id, ids, total) {
    const more = total - ids.length;
    return h(
      "ul",
      {class: "links", id},
      ...ids.map((other) => h("li", {}, h("a", {href: `#/task/${encodeURIComponent(other)}`}, other))),
      more > 0 && h("li", {class: "hint"}, `and ${formatInt(more)} more`),
    );
  }

  async function lookUp(id) {
    state.task = null;
    $("#task-result").replaceChildren(h("p", {class: "hint"}, "Looking up…"));
    try {
      await loadTask(id);
      clearError("view");
    } catch (e) {
      $("#task-result").replaceChildren();
      showError("view", e, `Looking up task ${id}`);
    }
  }

  // -- routing ---------------------------------------------------------------------------------

  function parseHash() {
    const raw = location.hash.replace(/^#\/?/, "");
    const [path, query] = raw.split("?");
    const parts = path.split("/");
    const view = Object.hasOwn(VIEWS, parts[0]) ? parts[0] : "overview";
    let arg = parts.slice(1).join("/");
    try {
      arg = decodeURIComponent(arg);
    } catch (e) {
      // keep it as typed
    }
    return {view, arg, params: new URLSearchParams(query || "")};
  }

  async function route() {
    const {view, arg, params} = parseHash();
    const changed = view !== state.view;
    state.view = view;
    for (const name of Object.keys(VIEWS)) {
      $(`#view-${name}`).hidden = name !== view;
      const tab = $(`#tab-${name}`);
      if (name === view) tab.setAttribute("aria-current", "page");
      else tab.removeAttribute("aria-current");
    }
    document.title = `${VIEWS[view]} · wq`;
    if (changed) clearError("view");
    if (view === "overview") {
      renderStats();
    } else if (view === "queues") {
      await refreshView();
    } else if (view === "tasks") {
      const queue = params.get("queue") || "default";
      const taskState = LIST_STATES.includes(params.get("state")) ? params.get("state") : "ready";
      if (changed || queue !== state.tasksQueue || taskState !== state.tasksState) state.tasksCursors = [""];
      state.tasksQueue = queue;
      state.tasksState = taskState;
      state.tasksKey = "";
      await refreshView();
    } else if (view === "schedules") {
      state.schedulesFocus = params.get("name") || "";
      state.schedulesKey = "";
      await refreshView();
    } else if (view === "dlq") {
      state.dlqQueue = params.get("queue") || "";
      state.dlqKey = "";
      await refreshView();
    } else if (view === "task") {
      $("#task-id").value = arg;
      if (arg) await lookUp(arg);
      else {
        state.task = null;
        $("#task-result").replaceChildren();
        $("#task-id").focus();
      }
    }
  }

  // -- wiring ----------------------------------------------------------------------------------

  function start() {
    $("#broker-host").textContent = location.host;
    $("#token-button").addEventListener("click", changeToken);
    $("#token-cancel").addEventListener("click", () => $("#token-dialog").close("cancel"));
    $("#token-forget").addEventListener("click", () => $("#token-dialog").close("forget"));
    $("#confirm-cancel").addEventListener("click", () => $("#confirm-dialog").close("cancel"));
    $("#live-toggle").addEventListener("click", () => setLive(!state.live));
    $("#dlq-refresh").addEventListener("click", () => {
      state.dlqKey = "";
      refreshView();
    });
    $("#dlq-requeue-all").addEventListener("click", requeueAll);
    $("#tasks-queue").addEventListener("change", (event) => {
      location.hash = tasksHash(event.target.value, state.tasksState);
    });
    $("#tasks-refresh").addEventListener("click", () => {
      state.tasksKey = "";
      refreshView();
    });
    $("#tasks-first").addEventListener("click", () => pageTo([""]));
    $("#tasks-prev").addEventListener("click", () => pageTo(state.tasksCursors.slice(0, -1)));
    $("#tasks-next").addEventListener("click", () => {
      const next = state.tasks && state.tasks.next_cursor;
      if (next) pageTo([...state.tasksCursors, next]);
    });
    $("#tasks-empty-queue").addEventListener("click", emptyQueue);
    $("#tasks-delete-queue").addEventListener("click", deleteQueue);
    $("#dlq-queue").addEventListener("change", (event) => {
      const queue = event.target.value;
      location.hash = queue ? `#/dlq?queue=${encodeURIComponent(queue)}` : "#/dlq";
    });
    $("#task-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const id = $("#task-id").value.trim();
      if (!id) return;
      const target = `#/task/${encodeURIComponent(id)}`;
      if (location.hash === target) lookUp(id);
      else location.hash = target;
    });
    window.addEventListener("hashchange", route);
    if (!location.hash) history.replaceState(null, "", "#/overview");
    route();
    loop();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
