/* omniflow: what every page shares — its data, formatting, tables, and the pipeline graph
   (laid out by dagre, drawn as SVG: stages in executors in devices, labelled edges). */
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";

  function data() {
    return JSON.parse(document.getElementById("omniflow-data").textContent);
  }

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "text") node.textContent = v;
      else if (k === "html") node.innerHTML = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children || []) node.append(c);
    return node;
  }

  function svg(tag, attrs, parent) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else node.setAttribute(k, v);
    }
    if (parent) parent.append(node);
    return node;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [unit, scale] of units) if (n >= scale) return (n / scale).toFixed(1) + " " + unit;
    return Math.round(n) + " B";
  }

  // A duration given in microseconds.
  function us(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 1 : 2) + " s";
    if (a >= 1e3) return (v / 1e3).toFixed(a >= 1e5 ? 0 : a >= 1e4 ? 1 : 2) + " ms";
    return v.toFixed(a >= 100 ? 0 : 1) + " µs";
  }

  function ms(v) {
    return v === null || v === undefined ? "–" : us(v * 1000);
  }

  function pct(v) {
    return v === null || v === undefined ? "–" : (100 * v).toFixed(v < 0.1 ? 1 : 0) + "%";
  }

  function num(v, digits) {
    if (v === null || v === undefined) return "–";
    return Number(v).toFixed(digits === undefined ? 0 : digits);
  }

  const PALETTE = ["#2563eb", "#f97316", "#16a34a", "#9333ea", "#dc2626", "#0891b2",
    "#ca8a04", "#db2777", "#4b5563", "#65a30d", "#7c3aed", "#0d9488"];
  function color(i) { return PALETTE[((i % PALETTE.length) + PALETTE.length) % PALETTE.length]; }

  function quantile(values, q) {
    if (!values.length) return null;
    const s = values.slice().sort((a, b) => a - b);
    const pos = (s.length - 1) * q, lo = Math.floor(pos), hi = Math.min(lo + 1, s.length - 1);
    return s[lo] + (s[hi] - s[lo]) * (pos - lo);
  }

  // A table: columns [{key, label, fmt, left}], rows of objects.
  function table(columns, rows, attrs) {
    const head = el("tr", {}, columns.map((c) => el("th", { class: c.left ? "left" : null, text: c.label })));
    const body = rows.map((r) => el("tr", r._attrs || {}, columns.map((c) => {
      const v = r[c.key];
      return el("td", { class: c.left ? "left" : null, text: c.fmt ? c.fmt(v, r) : (v === null || v === undefined ? "–" : String(v)) });
    })));
    return el("table", attrs || {}, [el("thead", {}, [head]), el("tbody", {}, body)]);
  }

  let measurer = null;
  function textWidth(text, font) {
    measurer = measurer || document.createElement("canvas").getContext("2d");
    measurer.font = font;
    return measurer.measureText(text).width;
  }
  const TITLE_FONT = "600 13px system-ui, sans-serif", SUB_FONT = "11px system-ui, sans-serif",
    EDGE_FONT = "10.5px system-ui, sans-serif", CLUSTER_FONT = "600 11px system-ui, sans-serif";
  const LINE = 14;

  /* Draw a graph model into `container`:
       {clusters: [{id, label, sub, parent, cls}], nodes: [{id, label, sub, parent, cls, data}],
        edges: [{id, from, to, label: [lines], cls}]}
     Returns {svg, nodes: {id: <g>}, edges: {id: <g>}, clusters: {id: <g>}}. */
  function drawGraph(container, model, options) {
    const opts = Object.assign({ rankdir: "TB" }, options || {});
    const g = new dagre.graphlib.Graph({ compound: true, multigraph: true });
    g.setGraph({ rankdir: opts.rankdir, nodesep: 40, ranksep: 60, edgesep: 16, marginx: 16, marginy: 16 });
    g.setDefaultEdgeLabel(() => ({}));
    const depth = {};
    const clusterById = {};
    for (const c of model.clusters || []) clusterById[c.id] = c;
    // A cluster's depth: how many clusters it holds inside one another (they draw first).
    const depthOf = (id) => {
      if (depth[id] !== undefined) return depth[id];
      let d = 0;
      for (const c of model.clusters || []) if (c.parent === id) d = Math.max(d, depthOf(c.id) + 1);
      return (depth[id] = d);
    };
    for (const c of model.clusters || []) g.setNode(c.id, { cluster: c });
    for (const c of model.clusters || []) if (c.parent && clusterById[c.parent]) g.setParent(c.id, c.parent);
    for (const n of model.nodes) {
      const lines = n.sub || [];
      const w = Math.max(textWidth(n.label, TITLE_FONT), ...lines.map((l) => textWidth(l, SUB_FONT)), 40) + 22;
      const h = 22 + lines.length * LINE + 8;
      g.setNode(n.id, { node: n, width: w, height: h });
      if (n.parent && clusterById[n.parent]) g.setParent(n.id, n.parent);
    }
    for (const e of model.edges) {
      const lines = e.label || [];
      const w = lines.length ? Math.max(...lines.map((l) => textWidth(l, EDGE_FONT))) + 8 : 0;
      g.setEdge(e.from, e.to, { edge: e, width: w, height: lines.length * 13 + 4, labelpos: "c" }, e.id);
    }
    // Top to bottom: dagre gives each cluster a rank of its own above its contents (its top
    // border), which is where its label goes.
    dagre.layout(g);

    const box = g.graph();
    const width = (box.width || 100) + 20, height = (box.height || 100) + 10;
    const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
    const layers = { clusters: svg("g", {}, root), edges: svg("g", {}, root), nodes: svg("g", {}, root) };
    const out = { svg: root, nodes: {}, edges: {}, clusters: {} };

    const sorted = (model.clusters || []).slice().sort((a, b) => depthOf(b.id) - depthOf(a.id));
    for (const c of sorted) {
      const n = g.node(c.id);
      if (!n || n.width === undefined) continue;
      const group = svg("g", { class: "cluster " + (c.cls || ""), "data-cluster": c.id }, layers.clusters);
      const x = n.x - n.width / 2, y = n.y - n.height / 2;
      svg("rect", { x, y, width: n.width, height: n.height }, group);
      svg("text", { class: "title", x: x + 8, y: y + 14, text: c.label }, group);
      (c.sub || []).forEach((line, i) => svg("text", { x: x + 8, y: y + 27 + i * 12, text: line }, group));
      if (c.title) svg("title", { text: c.title }, group);
      out.clusters[c.id] = group;
    }
    for (const id of g.edges()) {
      const info = g.edge(id);
      const e = info.edge;
      const group = svg("g", { class: "edge " + (e.cls || ""), "data-edge": e.id }, layers.edges);
      const pts = info.points;
      let d = `M${pts[0].x},${pts[0].y}`;
      for (let i = 1; i < pts.length; i++) d += ` L${pts[i].x},${pts[i].y}`;
      svg("path", { d, "marker-end": "url(#arrow)" }, group);
      const lines = e.label || [];
      if (lines.length && info.x !== undefined) {
        const h = lines.length * 13 + 4;
        svg("rect", { x: info.x - info.width / 2, y: info.y - h / 2, width: info.width, height: h, rx: 3 }, group);
        const text = svg("text", { x: info.x, y: info.y - h / 2 + 12, "text-anchor": "middle" }, group);
        group.spans = lines.map((l, i) => svg("tspan", { x: info.x, dy: i ? 13 : 0, text: l }, text));
      }
      if (e.title) svg("title", { text: e.title }, group);
      out.edges[e.id] = group;
    }
    for (const id of g.nodes()) {
      const info = g.node(id);
      if (!info.node) continue;
      const n = info.node;
      const group = svg("g", { class: "node " + (n.cls || ""), "data-node": n.id }, layers.nodes);
      if (n.cls && n.cls.split(" ").includes("stage")) group.setAttribute("data-stage", n.id);
      const x = info.x - info.width / 2, y = info.y - info.height / 2;
      svg("rect", { x, y, width: info.width, height: info.height }, group);
      group.meter = svg("rect", { class: "meter", x, y, width: 0, height: info.height }, group);
      svg("text", { class: "title", x: x + 11, y: y + 18, text: n.label }, group);
      group.lines = (n.sub || []).map((l, i) => svg("text", { x: x + 11, y: y + 34 + i * LINE, text: l }, group));
      group.box = { x, y, width: info.width, height: info.height };
      if (n.title) svg("title", { text: n.title }, group);
      out.nodes[n.id] = group;
    }
    const defs = svg("defs", {}, root);
    const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 9, markerHeight: 9, markerUnits: "userSpaceOnUse", orient: "auto-start-reverse" }, defs);
    svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#667085" }, marker);
    container.replaceChildren(root);
    return out;
  }

  // A meter behind a node's text: the fraction of its box filled (utilisation).
  function setMeter(group, fraction) {
    if (!group || !group.meter) return;
    const f = Math.max(0, Math.min(1, fraction || 0));
    group.meter.setAttribute("width", group.box.width * f);
  }

  function setLines(group, lines) {
    if (!group || !group.lines) return;
    group.lines.forEach((t, i) => { t.textContent = lines[i] !== undefined ? lines[i] : ""; });
  }

  window.omniflow = { data, el, svg, bytes, us, ms, pct, num, color, quantile, table, drawGraph, setMeter, setLines };
})();
