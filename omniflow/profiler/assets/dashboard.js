/* The live dashboard: the compiled graph with each stage's utilisation, queue depth and batch
   size and each edge's ring occupancy and throughput, from a JSON snapshot every second; it
   starts and stops profiles and links to the last one's trace and report. */
"use strict";
(function () {
  const O = window.omniflow;
  const D = O.data();
  const urls = D.urls;
  const HISTORY = 120;

  // A live line under every stage and edge, filled in by each snapshot.
  for (const n of D.graph.nodes) if (D.stages.includes(n.id)) n.sub = [...(n.sub || []), "util – · queue – · batch –"];
  for (const e of D.graph.edges) e.label = [...(e.label || []), e.cls === "local" ? "references" : "ring –/– · – chunks/s"];
  const graph = O.drawGraph(document.getElementById("graph"), D.graph);

  const lineChart = (id, yTitle, max) => new Chart(document.getElementById(id), {
    type: "line",
    data: { labels: [], datasets: D.stages.map((s, i) => ({ label: s, data: [], borderColor: O.color(i), backgroundColor: O.color(i), pointRadius: 0, tension: 0.2 })) },
    options: { animation: false, maintainAspectRatio: false, scales: { x: { display: false }, y: { min: 0, max, title: { display: true, text: yTitle } } } },
  });
  const util = lineChart("util", "utilisation %", 100);
  const queue = lineChart("queue", "requests");

  const status = document.getElementById("status");
  let failures = 0;
  async function refresh() {
    let snap;
    try {
      const response = await fetch(urls.snapshot, { cache: "no-store" });
      if (!response.ok) throw new Error(`${response.status}`);
      snap = await response.json();
      failures = 0;
    } catch (err) {
      failures += 1;
      status.textContent = `no snapshot (${err.message}); retrying`;
      return;
    }
    window.omniflowDashboard.last = snap;
    update(snap);
  }
  function update(snap) {
    for (const name of D.stages) {
      const s = snap.stages[name];
      const g = graph.nodes[name];
      if (!s || !g) continue;
      const line = `util ${O.pct(s.utilisation)} · queue ${s.queue} · batch ${s.batch === null ? "–" : O.num(s.batch, 1)}`;
      g.lines[g.lines.length - 1].textContent = line;
      O.setMeter(g, s.utilisation || 0);
    }
    for (const e of D.edges) {
      const s = snap.edges[e.name];
      const g = graph.edges[e.name];
      if (!s || !g || !g.spans || e.kind === "local") continue;
      const ring = s.used === null ? `ring –/${e.slots}` : `ring ${s.used}/${e.slots}${s.full ? " full" : ""}`;
      const waiting = s.queued ? ` · ${s.queued} waiting` : "";
      g.spans[g.spans.length - 1].textContent = `${ring}${waiting} · ${s.chunks_per_s === null ? "–" : O.num(s.chunks_per_s, 1)} chunks/s`;
    }
    const label = new Date().toLocaleTimeString();
    for (const [chart, value] of [[util, (s) => (s.utilisation === null ? null : 100 * s.utilisation)], [queue, (s) => s.queue]]) {
      chart.data.labels.push(label);
      chart.data.datasets.forEach((d, i) => d.data.push(value(snap.stages[D.stages[i]])));
      if (chart.data.labels.length > HISTORY) {
        chart.data.labels.shift();
        chart.data.datasets.forEach((d) => d.data.shift());
      }
      chart.update("none");
    }
    document.getElementById("stage-table").replaceChildren(O.table([
      { key: "stage", label: "stage", left: true }, { key: "executor", label: "executor", left: true },
      { key: "utilisation", label: "utilisation", fmt: O.pct }, { key: "queue", label: "requests held" },
      { key: "batch", label: "mean batch", fmt: (v) => O.num(v, 2) }, { key: "steps_per_s", label: "steps/s", fmt: (v) => O.num(v, 1) },
    ], D.stages.map((name) => Object.assign({ stage: name }, snap.stages[name])), { id: "stages" }));
    document.getElementById("edge-table").replaceChildren(O.table([
      { key: "edge", label: "edge", left: true }, { key: "kind", label: "buffer", left: true },
      { key: "used", label: "slots in use" }, { key: "slots", label: "slots" }, { key: "occupancy", label: "occupancy", fmt: O.pct },
      { key: "queued", label: "waiting for credits" }, { key: "chunks_per_s", label: "chunks/s", fmt: (v) => O.num(v, 1) },
      { key: "bytes_per_s", label: "bytes/s", fmt: (v) => (v === null ? "–" : O.bytes(v) + "/s") }, { key: "put_us", label: "put", fmt: O.us },
    ], D.edges.map((e) => Object.assign({ edge: e.name }, snap.edges[e.name])), { id: "edges" }));
    showProfile(snap.profile || {});
    const requests = snap.requests === null || snap.requests === undefined ? "" : `${snap.requests} requests in flight · `;
    if (!busy) status.textContent = `${requests}updated ${label}`;
  }

  // --- profiles ------------------------------------------------------------------------------
  const start = document.getElementById("start"), stop = document.getElementById("stop");
  const report = document.getElementById("report"), trace = document.getElementById("trace");
  let busy = false;
  function showProfile(p) {
    start.disabled = busy || !!p.on;
    stop.disabled = busy || !p.on;
    start.textContent = p.on ? `Profiling… ${O.num(p.seconds || 0, 0)} s` : "Start profile";
    report.hidden = trace.hidden = !p.trace;
    report.href = urls.report;
    trace.href = urls.trace;
  }
  async function post(url, what) {
    busy = true;
    start.disabled = stop.disabled = true;
    status.textContent = `${what}…`;
    try {
      const response = await fetch(url, { method: "POST" });
      if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
      const answer = await response.json();
      status.textContent = `${what}: done` + (answer.events !== undefined ? ` (${answer.events} events)` : "");
      return answer;
    } catch (err) {
      status.textContent = `${what} failed: ${err.message}`;
      return null;
    } finally {
      busy = false;
      refresh();
    }
  }
  start.addEventListener("click", () => post(urls.start, "starting a profile"));
  stop.addEventListener("click", () => post(urls.stop, "stopping the profile"));

  window.omniflowDashboard = { refresh, last: null };
  refresh();
  setInterval(refresh, D.refresh_ms);
})();
