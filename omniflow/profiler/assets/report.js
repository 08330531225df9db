/* The profile report: the compiled graph, a waterfall per request with a picker, latency
   distributions, per-stage and per-edge tables, and where the selected requests' time went. */
"use strict";
(function () {
  const O = window.omniflow;
  const D = O.data();
  const lanes = D.lanes;
  const outputs = D.outputs;
  const headline = D.headline === null ? -1 : outputs.indexOf(D.headline);
  const requests = D.requests;
  const byId = new Map(requests.map((r) => [r.id, r]));
  const laneLabels = ["inputs", ...lanes, "outputs"];
  const laneOf = (name) => {
    const i = lanes.indexOf(name);
    if (i >= 0) return laneLabels[i + 1];
    return D.inputs.includes(name) ? "inputs" : "outputs";
  };
  const stageColor = (name) => O.color(lanes.indexOf(name));
  const state = { selected: requests.slice(), current: null };

  // --- header ------------------------------------------------------------------------------
  const complete = requests.filter((r) => r.ok);
  const dropped = Object.entries(D.dropped || {}).map(([e, n]) => `${e} dropped ${n} events`);
  // Requests whose E2E path has time no event explains (their route is cut short there).
  const unrecordedKinds = new Set(D.owners.flatMap((o, i) => (o.kind === "unrecorded" ? [i] : [])));
  const partlyRecorded = (r) => {
    const flat = r.cpE || [];
    for (let i = 0; i < flat.length; i += 2) if (unrecordedKinds.has(flat[i])) return true;
    return false;
  };
  const partly = requests.filter(partlyRecorded).length;
  document.getElementById("subtitle").textContent = [
    `${requests.length} requests (${complete.length} complete)`,
    `profile of ${O.us(D.window_us)}`,
    `executors: ${D.executors.join(", ")}`,
    D.has_plan ? null : "the trace has no plan: graph from its events only",
    partly ? `${partly} request${partly > 1 ? "s" : ""} began before every executor on ${partly > 1 ? "their" : "its"} path was recording` : null,
    ...dropped,
  ].filter(Boolean).join(" · ");

  // --- the graph ---------------------------------------------------------------------------
  const stageStats = Object.fromEntries(D.stages.map((s) => [s.stage, s]));
  const edgeStats = Object.fromEntries(D.edges.map((e) => [e.edge, e]));
  for (const n of D.graph.nodes) {
    const s = stageStats[n.id];
    if (s) n.sub = [...(n.sub || []), `util ${O.pct(s.utilisation)} · mean batch ${O.num(s.batch_mean, 1)} · step p50 ${O.us(s.step_p50_us)}`];
  }
  for (const e of D.graph.edges) {
    const s = edgeStats[e.id];
    if (s && s.chunks) e.label = [...(e.label || []), `${s.chunks} chunks · hand-off p50 ${O.us(s.handoff_p50_us)}`];
  }
  const graph = O.drawGraph(document.getElementById("graph"), D.graph);
  for (const [id, g] of Object.entries(graph.nodes)) if (stageStats[id]) O.setMeter(g, stageStats[id].utilisation);
  const deviceRows = D.devices.map((d) => ({
    device: d.device, usable: d.usable_bytes, used: d.used_bytes,
    budgets: d.stages.map((s) => `${s.stage} ${O.bytes(s.budget_bytes)} (needs ${O.bytes(s.need_bytes)})`).join(", "),
  }));
  if (deviceRows.length) {
    document.getElementById("device-table").append(O.table([
      { key: "device", label: "device", left: true }, { key: "usable", label: "usable", fmt: O.bytes },
      { key: "used", label: "needed", fmt: O.bytes }, { key: "budgets", label: "memory budgets", left: true },
    ], deviceRows, { id: "devices" }));
  }

  // --- where the time went -----------------------------------------------------------------
  function sum(flat, into) {
    if (!flat) return;
    for (let i = 0; i < flat.length; i += 2) into[flat[i]] = (into[flat[i]] || 0) + flat[i + 1];
  }
  // Time before an executor's events begin (it started recording after the request did, or
  // its ring overwrote them) belongs to no stage or edge: it is one owner of its own.
  const UNRECORDED = "time the profile did not record";
  function owners(totals) {
    const by = {};
    totals.forEach((v, i) => {
      if (!v) return;
      const o = D.owners[i];
      const name = o.kind === "unrecorded" ? UNRECORDED : o.owner;
      const entry = by[name] || (by[name] = { owner: name, edge: !!o.edge, unrecorded: o.kind === "unrecorded", steps: 0, waiting: 0, edgeTime: 0, total: 0 });
      if (o.kind === "steps") entry.steps += v; else if (o.kind === "waiting") entry.waiting += v; else if (o.kind === "edge") entry.edgeTime += v;
      entry.total += v;
    });
    return Object.values(by).sort((a, b) => b.total - a.total);
  }
  function sentence(label, list, field, what) {
    const totals = new Array(D.components.length).fill(0);
    for (const r of list) sum(field(r), totals);
    const all = totals.reduce((a, b) => a + b, 0);
    const ranked = owners(totals);
    if (!all || !ranked.length) return { html: `${label}: no complete request to measure.`, totals };
    const top = ranked[0];
    const share = (v) => `${Math.round((100 * v) / all)}%`;
    let why;
    if (top.unrecorded) why = `${share(top.total)} of ${what} passed before the events of an executor on the path begin (it started recording after the request did, or its ring overwrote them)`;
    else if (top.edge) why = `${share(top.total)} of ${what} is spent handing chunks over the edge ${top.owner}${top.waiting ? ` (${share(top.waiting)} waiting for the rest of the input)` : ""}`;
    else {
      const parts = [];
      if (top.steps) parts.push(`${share(top.steps)} its steps`);
      if (top.waiting) parts.push(`${share(top.waiting)} waiting for its turn`);
      why = `${share(top.total)} of ${what} is in ${top.owner} (${parts.join(", ")})`;
    }
    return { html: `${label} is bound by <b>${top.owner}</b>: ${why}.`, totals, ranked };
  }
  function routeText(list) {
    const count = new Map();
    const whole = list.filter((r) => r.ok && !partlyRecorded(r));
    if (whole.length) list = whole;
    for (const r of list) {
      if (!r.ok) continue;
      const key = JSON.stringify([r.route, r.last]);
      count.set(key, (count.get(key) || 0) + 1);
    }
    let best = null, n = 0;
    for (const [k, v] of count) if (v > n) { best = k; n = v; }
    if (best === null) return "";
    const [route, last] = JSON.parse(best);
    const names = [D.inputs.join(" + "), ...route.map((i) => lanes[i]), last === null ? "output" : outputs[last]];
    return `Critical path${n < list.length ? ` (${n} of ${list.filter((r) => r.ok).length} requests)` : ""}: <b>${names.join(" → ")}</b>.`;
  }
  function median(values) { return O.quantile(values.filter((v) => v !== null && v !== undefined), 0.5); }
  function summarize() {
    const list = state.selected.filter((r) => r.ok);
    const scope = state.selected.length === requests.length ? `all ${requests.length} requests` : `${state.selected.length} requests matching “${filter.value}”`;
    document.getElementById("summary-scope").textContent = `— ${scope}`;
    const lines = [routeText(list)];
    const hl = headline >= 0 ? outputs[headline] : null;
    if (hl) {
      const t = sentence(`TTFP (first ${hl} packet, median ${O.ms(median(list.map((r) => r.ttfp[headline])))})`, list, (r) => r.cpT[headline], `the time to the first ${hl} packet`);
      lines.push(t.html);
    }
    const e = sentence(`E2E (median ${O.ms(median(list.map((r) => r.e2e)))})`, list, (r) => r.cpE, "the end-to-end time");
    lines.push(e.html);
    const cur = state.current;
    if (cur && cur.ok) {
      const one = sentence(`Request ${cur.id}'s E2E (${O.ms(cur.e2e)})`, [cur], (r) => r.cpE, "its end-to-end time");
      lines.push(`<span class="muted">${one.html}</span>`);
    }
    const text = document.getElementById("summary-text");
    text.replaceChildren(...lines.filter(Boolean).map((h) => O.el("p", { html: h })));
    // The E2E critical path's make-up, stacked.
    const bar = document.getElementById("summary-bar"), legend = document.getElementById("summary-legend");
    bar.replaceChildren(); legend.replaceChildren();
    const all = e.totals.reduce((a, b) => a + b, 0);
    if (!all) return;
    const order = e.totals.map((v, i) => [v, i]).filter(([v]) => v > 0).sort((a, b) => b[0] - a[0]);
    order.forEach(([v, i], k) => {
      const name = D.components[i];
      const c = componentColor(i);
      bar.append(O.el("span", { style: `width:${(100 * v) / all}%;background:${c}`, title: `${name}: ${Math.round((100 * v) / all)}%` }));
      if (k < 12) legend.append(O.el("span", {}, [O.el("i", { style: `background:${c}` }), `${name} ${Math.round((100 * v) / all)}%`]));
    });
  }
  function componentColor(i) {
    const o = D.owners[i];
    if (o.kind === "unrecorded") return "#e4e7ec";
    const base = o.edge ? "#98a2b3" : O.color(lanes.indexOf(o.owner));
    return o.kind === "waiting" ? base + "66" : base;
  }

  // --- the request picker ------------------------------------------------------------------
  const filter = document.getElementById("filter");
  const sortBy = document.getElementById("sort");
  const picker = document.getElementById("picker");
  function label(r) {
    const t = headline >= 0 ? r.ttfp[headline] : null;
    return `${r.id.padEnd(12)} E2E ${O.ms(r.e2e).padStart(8)}  TTFP ${O.ms(t).padStart(8)}${r.ok ? "" : "  (partial)"}`;
  }
  function refreshList(keepCurrent) {
    const needle = filter.value.trim().toLowerCase();
    let list = needle ? requests.filter((r) => r.id.toLowerCase().includes(needle)) : requests.slice();
    const key = sortBy.value;
    if (key === "e2e") list.sort((a, b) => (b.e2e || 0) - (a.e2e || 0));
    else if (key === "ttfp") list.sort((a, b) => (b.ttfp[headline] || 0) - (a.ttfp[headline] || 0));
    state.selected = list;
    const frag = document.createDocumentFragment();
    for (const r of list) frag.append(new Option(label(r), r.id));
    picker.replaceChildren(frag);
    document.getElementById("pick-count").textContent = `${list.length} of ${requests.length} requests`;
    const keep = keepCurrent && state.current && list.includes(state.current);
    pick(keep ? state.current : list[0] || null);
  }
  function pick(r) {
    state.current = r;
    if (r) picker.value = r.id;
    drawWaterfall(r);
    summarize();
  }
  filter.addEventListener("input", () => refreshList(true));
  sortBy.addEventListener("change", () => refreshList(true));
  picker.addEventListener("change", () => pick(byId.get(picker.value)));

  // --- the waterfall -----------------------------------------------------------------------
  let waterfall = null;
  function waterfallData(r) {
    const datasets = [];
    const unit = r.q / 1000; // ms per grid step
    lanes.forEach((stage, i) => {
      const flat = r.lanes[i] || [];
      const pts = [];
      for (let k = 0; k < flat.length; k += 3) {
        pts.push({ x: [flat[k] * unit, (flat[k] + flat[k + 1]) * unit], y: laneLabels[i + 1], n: flat[k + 2] });
      }
      datasets.push({ type: "bar", label: stage, data: pts, backgroundColor: O.color(i), borderSkipped: false, barPercentage: 0.55, categoryPercentage: 1, grouped: false, order: 2 });
    });
    for (const row of r.hand) {
      const ch = D.channels[row[0]];
      const pts = [];
      for (let k = 1; k < row.length; k += 2) {
        pts.push({ x: row[k] * unit, y: laneOf(ch.src) }, { x: row[k + 1] * unit, y: laneOf(ch.dst) }, { x: null, y: null });
      }
      datasets.push({ type: "line", label: `hand-off ${ch.name}`, data: pts, borderColor: "#475467", backgroundColor: "#475467", borderWidth: 1, pointRadius: 1.5, spanGaps: false, order: 1 });
    }
    const mark = (x, name, colour) => ({ type: "line", label: name, data: [{ x, y: laneLabels[0] }, { x, y: laneLabels[laneLabels.length - 1] }], borderColor: colour, borderDash: [6, 4], borderWidth: 2, pointRadius: 0, order: 0 });
    if (headline >= 0 && r.ttfp[headline] !== null) datasets.push(mark(r.ttfp[headline], `TTFP (${outputs[headline]})`, "#16a34a"));
    if (r.e2e !== null) datasets.push(mark(r.e2e, "E2E", "#dc2626"));
    return datasets;
  }
  function drawWaterfall(r) {
    const title = document.getElementById("waterfall-title");
    const note = document.getElementById("waterfall-note");
    if (!r) {
      title.textContent = "no request matches";
      if (waterfall) { waterfall.data.datasets = []; waterfall.update("none"); }
      return;
    }
    const ttfp = headline >= 0 ? r.ttfp[headline] : null;
    // What backends counted for it (a denoiser's step cache: steps computed and reused; what
    // reuse costs in the image is measured against an uncached run by benchmarks/diffusion.py
    // and video.py, and needs real weights to mean anything).
    const counted = Object.entries(r.counted || {}).map(([stage, c]) => `${stage} ${Object.entries(c).map(([k, v]) => `${k} ${v}`).join(", ")}`);
    title.textContent = `Request ${r.id}: TTFP ${O.ms(ttfp)}, E2E ${O.ms(r.e2e)}${counted.length ? `; ${counted.join("; ")}` : ""}${r.ok ? "" : " (partial: it began or ended outside the profile)"}`;
    note.textContent = "A bar is a step of the stage that advanced this request (neighbouring steps merge when they are too close to see; the tooltip says how many); a line is a chunk handed from one lane to the next.";
    const datasets = waterfallData(r);
    if (waterfall) {
      waterfall.data.datasets = datasets;
      waterfall.update("none");
      return;
    }
    waterfall = new Chart(document.getElementById("waterfall"), {
      type: "bar",
      data: { labels: laneLabels, datasets },
      options: {
        indexAxis: "y", animation: false, maintainAspectRatio: false, parsing: true,
        scales: {
          x: { type: "linear", min: 0, title: { display: true, text: "ms since the request's inputs went out" } },
          y: { type: "category", labels: laneLabels, grid: { display: true } },
        },
        plugins: {
          legend: {
            labels: {
              // One entry for every edge's hand-offs: the first edge's, renamed.
              filter: (item, data) => {
                const first = data.datasets.findIndex((d) => d.label.startsWith("hand-off"));
                return !data.datasets[item.datasetIndex].label.startsWith("hand-off") || item.datasetIndex === first;
              },
              generateLabels(chart) {
                const items = Chart.defaults.plugins.legend.labels.generateLabels(chart);
                for (const item of items) if (item.text.startsWith("hand-off")) item.text = "chunk hand-offs";
                return items;
              },
            },
          },
          tooltip: {
            callbacks: {
              label(ctx) {
                const raw = ctx.raw;
                if (raw && Array.isArray(raw.x)) {
                  return `${ctx.dataset.label}: ${O.ms(raw.x[0])} → ${O.ms(raw.x[1])} (${O.ms(raw.x[1] - raw.x[0])}, ${raw.n} step${raw.n > 1 ? "s" : ""})`;
                }
                return raw && raw.x !== null ? `${ctx.dataset.label} @ ${O.ms(raw.x)}` : "";
              },
            },
          },
        },
      },
    });
    window.omniflowReport.waterfall = waterfall;
  }

  // --- latency ------------------------------------------------------------------------------
  function cdf(values) {
    const s = values.filter((v) => v !== null && v !== undefined).sort((a, b) => a - b);
    return s.map((v, i) => ({ x: v, y: (i + 1) / s.length }));
  }
  const latencySeries = [{ name: "E2E", values: complete.map((r) => r.e2e), colour: "#dc2626" }];
  outputs.forEach((o, i) => latencySeries.push({ name: `TTFP ${o}`, values: complete.map((r) => r.ttfp[i]), colour: ["#16a34a", "#9333ea", "#0891b2", "#ca8a04"][i % 4] }));
  new Chart(document.getElementById("cdf"), {
    type: "scatter",
    data: { datasets: latencySeries.map((s) => ({ label: s.name, data: cdf(s.values), showLine: true, borderColor: s.colour, backgroundColor: s.colour, pointRadius: 0, stepped: true })) },
    options: { animation: false, maintainAspectRatio: false, scales: { x: { type: "linear", title: { display: true, text: "ms" } }, y: { min: 0, max: 1, title: { display: true, text: "fraction of requests" } } } },
  });
  const scatter = new Chart(document.getElementById("scatter"), {
    type: "scatter",
    data: {
      datasets: [
        { label: "E2E", data: complete.map((r) => ({ x: r.t0 / 1000, y: r.e2e, id: r.id })), backgroundColor: "#dc2626" },
        { label: headline >= 0 ? `TTFP ${outputs[headline]}` : "TTFP", data: complete.map((r) => ({ x: r.t0 / 1000, y: headline >= 0 ? r.ttfp[headline] : null, id: r.id })), backgroundColor: "#16a34a" },
      ],
    },
    options: {
      animation: false, maintainAspectRatio: false,
      scales: { x: { title: { display: true, text: "arrival (s into the profile)" } }, y: { title: { display: true, text: "ms" } } },
      plugins: { tooltip: { callbacks: { label: (ctx) => `${ctx.raw.id}: ${O.ms(ctx.raw.y)}` } } },
      onClick(event, elements) {
        if (!elements.length) return;
        const p = elements[0];
        const r = byId.get(scatter.data.datasets[p.datasetIndex].data[p.index].id);
        if (r) { if (!state.selected.includes(r)) { filter.value = ""; refreshList(false); } pick(r); }
      },
    },
  });
  const latencyRows = latencySeries.map((s) => {
    const v = s.values.filter((x) => x !== null && x !== undefined);
    return { metric: s.name, n: v.length, p50: O.quantile(v, 0.5), p90: O.quantile(v, 0.9), p99: O.quantile(v, 0.99), max: v.length ? Math.max(...v) : null, mean: v.length ? v.reduce((a, b) => a + b, 0) / v.length : null };
  });
  document.getElementById("latency-table").append(O.table([
    { key: "metric", label: "latency", left: true }, { key: "n", label: "requests" },
    { key: "p50", label: "p50", fmt: O.ms }, { key: "p90", label: "p90", fmt: O.ms }, { key: "p99", label: "p99", fmt: O.ms },
    { key: "mean", label: "mean", fmt: O.ms }, { key: "max", label: "max", fmt: O.ms },
  ], latencyRows, { id: "latency" }));

  // --- stages and edges -----------------------------------------------------------------------
  document.getElementById("stage-table").append(O.table([
    { key: "stage", label: "stage", left: true }, { key: "executor", label: "executor", left: true },
    { key: "steps", label: "steps" }, { key: "requests", label: "requests" }, { key: "emitted", label: "items out" },
    { key: "batch_mean", label: "mean batch", fmt: (v) => O.num(v, 2) }, { key: "batch_max", label: "max batch" },
    { key: "step_mean_us", label: "step mean", fmt: O.us }, { key: "step_p50_us", label: "step p50", fmt: O.us },
    { key: "step_p99_us", label: "step p99", fmt: O.us }, { key: "busy_us", label: "busy", fmt: O.us },
    { key: "utilisation", label: "utilisation", fmt: O.pct },
    // What a backend counted (a denoiser's step cache: steps computed / reused).
    { key: "counters", label: "counted", left: true,
      fmt: (v) => Object.entries(v || {}).map(([k, n]) => `${k.replace("steps_", "")} ${n}`).join(", ") || "-" },
  ], D.stages, { id: "stages" }));
  const sizes = [...new Set(D.stages.flatMap((s) => Object.keys(s.batch_hist).map(Number)))].sort((a, b) => a - b);
  new Chart(document.getElementById("batches"), {
    type: "bar",
    data: { labels: sizes.map(String), datasets: D.stages.map((s) => ({ label: s.stage, backgroundColor: stageColor(s.stage), data: sizes.map((b) => (s.batch_hist[b] || 0) / Math.max(1, s.steps)) })) },
    options: { animation: false, maintainAspectRatio: false, scales: { x: { title: { display: true, text: "batch size" } }, y: { title: { display: true, text: "fraction of steps" } } } },
  });
  new Chart(document.getElementById("steptimes"), {
    type: "bar",
    data: { labels: D.stages.map((s) => s.stage), datasets: [
      { label: "p50", data: D.stages.map((s) => (s.step_p50_us || 0) / 1000), backgroundColor: "#2563eb" },
      { label: "p99", data: D.stages.map((s) => (s.step_p99_us || 0) / 1000), backgroundColor: "#93c5fd" },
    ] },
    options: { animation: false, maintainAspectRatio: false, scales: { y: { title: { display: true, text: "ms per step" } } } },
  });
  document.getElementById("edge-table").append(O.table([
    { key: "edge", label: "edge", left: true }, { key: "kind", label: "buffer", left: true, fmt: (v, r) => (v === "local" ? "local reference" : `ring ${r.slots}×${O.bytes(r.slot_bytes)}`) },
    { key: "schedule", label: "schedule", left: true, fmt: (v) => (v ? v.slice(0, 4).join(",") + (v.length > 4 ? "…" : "") : "whole") },
    { key: "chunks", label: "chunks put" }, { key: "taken", label: "taken" },
    { key: "put_only", label: "never taken" }, { key: "take_only", label: "put unrecorded" },
    { key: "bytes", label: "bytes", fmt: O.bytes },
    { key: "put_mean_us", label: "put mean", fmt: O.us }, { key: "put_p99_us", label: "put p99", fmt: O.us },
    { key: "handoff_p50_us", label: "hand-off p50", fmt: O.us }, { key: "handoff_p99_us", label: "hand-off p99", fmt: O.us },
    { key: "peak_in_flight", label: "peak in flight" },
  ], D.edges, { id: "edges" }));

  window.omniflowReport = { lanes, laneLabels, waterfall: null, pick: (id) => pick(byId.get(id)), state };
  refreshList(false);
})();
