/* The compiler's passes: the graph after each pass, steppable (buttons, ← →), with what the
   pass changed outlined in the graph and listed beside it. */
"use strict";
(function () {
  const O = window.omniflow;
  const D = O.data();
  const passes = D.passes;
  const CATEGORY_COLOURS = {
    models: "#0891b2", types: "#2563eb", costs: "#9333ea", devices: "#16a34a",
    fusion: "#f97316", chunks: "#db2777", buffers: "#ca8a04", other: "#4b5563",
  };
  let current = 0;
  let drawn = null;

  const total = passes.reduce((a, p) => a + p.seconds, 0);
  document.getElementById("subtitle").textContent =
    `${passes.length - 1} passes in ${O.us(total * 1e6)}` + (D.devices ? ` · devices ${D.devices}` : "") +
    " · ← → step through them";

  const bar = document.getElementById("passes");
  const prev = O.el("button", { class: "nav", id: "prev", text: "← previous", onclick: () => show(current - 1) });
  const next = O.el("button", { class: "nav", id: "next", text: "next →", onclick: () => show(current + 1) });
  const buttons = passes.map((p, i) => O.el("button", {
    "data-pass": p.name, text: `${i}. ${p.name}`, title: p.about, onclick: () => show(i),
  }));
  bar.append(prev, ...buttons, next);

  const legend = document.getElementById("legend");
  for (const [name, colour] of Object.entries(CATEGORY_COLOURS)) {
    legend.append(O.el("span", {}, [O.el("i", { style: `background:${colour}` }), name]));
  }

  function show(i) {
    current = Math.max(0, Math.min(passes.length - 1, i));
    const p = passes[current];
    buttons.forEach((b, k) => b.classList.toggle("current", k === current));
    prev.disabled = current === 0;
    next.disabled = current === passes.length - 1;
    drawn = O.drawGraph(document.getElementById("graph"), p.graph);
    document.getElementById("pass-title").textContent = current === 0
      ? "before the passes" : `after ${p.name} (${O.us(p.seconds * 1e6)})`;
    document.getElementById("pass-about").textContent = p.about;
    const list = document.getElementById("changes");
    list.replaceChildren();
    if (current > 0 && !p.changes.length) list.append(O.el("li", { class: "muted", text: "this pass changed nothing here" }));
    for (const c of p.changes) {
      const tag = O.el("span", { class: "tag", style: `background:${CATEGORY_COLOURS[c.category] || "#4b5563"}`, text: c.category });
      const item = O.el("li", { "data-where": c.where }, [tag, O.el("b", { text: c.where }), ` ${c.key} = `, O.el("code", { text: c.value })]);
      if (c.was !== null) item.append(O.el("span", { class: "muted", text: ` (was ${c.was})` }));
      item.addEventListener("mouseenter", () => highlight(c.where, true));
      item.addEventListener("mouseleave", () => highlight(c.where, false));
      list.append(item);
    }
    window.omniflowViz.current = current;
  }
  function highlight(where, on) {
    const g = drawn && (drawn.nodes[where] || drawn.edges[where]);
    if (g) g.classList.toggle("selected", on);
  }
  document.addEventListener("keydown", (e) => {
    if (e.key === "ArrowRight") show(current + 1);
    else if (e.key === "ArrowLeft") show(current - 1);
  });
  window.omniflowViz = { show, passes: passes.map((p) => p.name), current: 0 };
  show(passes.length - 1);
})();
