"use strict";
// The live page: polls /model-stats and /kernel-stats and draws them with the DOM and plain SVG.
// No libraries, nothing fetched but this server's JSON; URLs are relative, so a path prefix works.

const KEY_STORE = "fusedserve-api-key";
const COLORS = ["#2f6fdb", "#e0803a", "#2e8b57", "#b03a8c", "#8a6d1d", "#3aa6b9", "#6b5bd6", "#c0392b"];
const page = { timer: null, run: 0, paused: false, waitingForKey: false, previous: null };

class KeyNeeded extends Error {}

// ---- talking to the server -------------------------------------------------------------------
async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers.set("Authorization", "Bearer " + key);
  const r = await fetch(path, { ...options, headers, cache: "no-store" });
  if (r.status === 401) {
    askForKey(key ? "That key was refused: enter another." : "This server asks for an API key.");
    throw new KeyNeeded();
  }
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(`${path}: ${r.status} ${body.error || r.statusText}`);
  return body;
}

function askForKey(why) {
  page.waitingForKey = true;
  document.getElementById("auth-why").textContent = why;
  document.getElementById("auth").hidden = false;
  document.getElementById("key").focus();
}

// ---- small helpers ---------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const svg = ["svg", "g", "line", "polyline", "rect", "circle", "text", "title", "path"].includes(tag);
  const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) node.setAttribute(k, v);
  for (const c of children.flat()) if (c !== undefined && c !== null) node.append(c instanceof Node ? c : String(c));
  return node;
}

function fmtSeconds(s) {
  if (!s) return "–";
  if (s < 1e-3) return (s * 1e6).toFixed(s < 1e-5 ? 1 : 0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(s < 1e-2 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}

function fmtNumber(x, digits = 3) {
  if (!x) return "0";
  if (Math.abs(x) >= 1000) return Math.round(x).toLocaleString("en");
  if (Math.abs(x) < 1e-3) return x.toExponential(digits - 1);
  return Number(x.toPrecision(digits)).toString();
}

function fmtShare(percent) {
  return percent < 1 ? percent.toPrecision(2) : percent.toFixed(1);
}

function figure(label, value, field, bad = false) {
  return el("div", { class: "figure" + (bad ? " bad" : "") },
    el("div", { class: "label" }, label), el("div", { class: "value", "data-field": field }, value));
}

// ---- one model -------------------------------------------------------------------------------
function liveRate(name, model, now) {
  // Requests per second since the previous poll; the average since reset on the first one.
  const prev = page.previous;
  if (prev && prev.models[name] !== undefined && model.requests >= prev.models[name] && now > prev.t)
    return (model.requests - prev.models[name]) / ((now - prev.t) / 1000);
  return model.requests_per_s;
}

function renderFigures(name, model, kernel, now) {
  const errors = Object.entries(model.errors_by_status);
  const errorText = errors.length ? errors.map(([s, n]) => `${s} ×${n}`).join("  ") : "none";
  const wait = (kernel && kernel.queue_wait) || model.queue_wait;
  return el("div", { class: "figures" },
    figure("requests / s", fmtNumber(liveRate(name, model, now)), "rate"),
    figure("requests since reset", fmtNumber(model.requests), "requests"),
    figure("latency p50", fmtSeconds(model.latency.p50_s), "latency-p50"),
    figure("latency p99", fmtSeconds(model.latency.p99_s), "latency-p99"),
    figure("queue depth (rows)", fmtNumber(model.queued_rows), "queued"),
    figure("queue wait p50 / p99", `${fmtSeconds(wait.p50_s)} / ${fmtSeconds(wait.p99_s)}`, "queue-wait"),
    figure("batches", fmtNumber(kernel ? kernel.batches : 0), "batches"),
    figure("errors by status", errorText, "errors", errors.length > 0));
}

function histogram(counts) {
  // Bars of batches per batch size (rows), one per size seen; with many sizes, some labels only.
  const entries = Object.entries(counts || {}).map(([k, v]) => [Number(k), v]).sort((a, b) => a[0] - b[0]);
  const W = 340, H = 170, left = 30, bottom = 20, top = 26;
  const svg = el("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, "data-chart": "batch-sizes" });
  svg.append(el("line", { class: "axis", x1: left, y1: H - bottom, x2: W - 4, y2: H - bottom }));
  svg.append(el("text", { x: 2, y: 10 }, "batches by rows"));
  if (!entries.length) {
    svg.append(el("text", { x: left + 10, y: H / 2 }, "no batches since reset"));
    return svg;
  }
  const max = Math.max(...entries.map((e) => e[1]));
  const slot = (W - left - 8) / entries.length, width = Math.max(1, Math.min(28, slot - 2));
  const every = Math.ceil(entries.length / 10); // at most ~10 size labels under the bars
  svg.append(el("text", { x: left - 4, y: top + 3, "text-anchor": "end" }, fmtNumber(max)));
  entries.forEach(([size, n], i) => {
    const h = ((H - bottom - top) * n) / max, x = left + i * slot + (slot - width) / 2;
    svg.append(el("rect", { class: "bar", x, y: H - bottom - h, width, height: h },
      el("title", {}, `${n} batches of ${size} rows`)));
    if (i % every === 0 || i === entries.length - 1)
      svg.append(el("text", { x: x + width / 2, y: H - 6, "text-anchor": "middle" }, size));
    if (slot >= 16) svg.append(el("text", { x: x + width / 2, y: H - bottom - h - 2, "text-anchor": "middle" }, n));
  });
  return svg;
}

function logScale(lo, hi, a, b) {
  const l0 = Math.log10(lo), l1 = Math.log10(hi);
  return (v) => a + ((Math.log10(v) - l0) / (l1 - l0)) * (b - a);
}

function fmtDecade(v) {
  // Axis ticks: plain numbers near 1, powers of ten (10⁻⁶) beyond.
  if (v >= 0.01 && v <= 100) return fmtNumber(v);
  const sup = { "-": "⁻", 0: "⁰", 1: "¹", 2: "²", 3: "³", 4: "⁴", 5: "⁵", 6: "⁶", 7: "⁷", 8: "⁸", 9: "⁹" };
  return "10" + [...String(Math.round(Math.log10(v)))].map((c) => sup[c]).join("");
}

function decades(lo, hi) {
  const out = [];
  for (let e = Math.ceil(Math.log10(lo)); e <= Math.floor(Math.log10(hi)); e++) out.push(10 ** e);
  return out;
}

function roofline(layers, peaks, dtype) {
  // x: arithmetic intensity (flop per byte moved), y: achieved TFLOP/s; the roof is
  // min(peak TFLOP/s, intensity x peak TB/s), both log scales.
  const W = 560, H = 270, left = 44, right = 10, top = 16, bottom = 34;
  const peak = peaks.tflops[dtype] || Math.max(...Object.values(peaks.tflops)), tbps = peaks.tbps;
  const ridge = peak / tbps;
  const pts = layers.filter((r) => r.tflops > 0 && r.gbps > 0).map((r) => ({ r, ai: (1e3 * r.tflops) / r.gbps }));
  const xs = pts.map((p) => p.ai), ys = pts.map((p) => p.r.tflops);
  const xlo = 10 ** Math.floor(Math.log10(Math.min(0.1, ...xs) / 2)), xhi = 10 ** Math.ceil(Math.log10(Math.max(ridge * 8, ...xs)));
  const ylo = 10 ** Math.floor(Math.log10(Math.min(peak / 1e4, ...ys) / 2)), yhi = 10 ** Math.ceil(Math.log10(peak * 1.5));
  const x = logScale(xlo, xhi, left, W - right), y = logScale(ylo, yhi, H - bottom, top);
  const svg = el("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, "data-chart": "roofline" });
  for (const v of decades(xlo, xhi)) {
    svg.append(el("line", { class: "axis", x1: x(v), y1: top, x2: x(v), y2: H - bottom }));
    svg.append(el("text", { x: x(v), y: H - bottom + 12, "text-anchor": "middle" }, fmtDecade(v)));
  }
  for (const v of decades(ylo, yhi)) {
    svg.append(el("line", { class: "axis", x1: left, y1: y(v), x2: W - right, y2: y(v) }));
    svg.append(el("text", { x: left - 4, y: y(v) + 3, "text-anchor": "end" }, fmtDecade(v)));
  }
  const roof = [[xlo, xlo * tbps], [ridge, peak], [xhi, peak]].map(([a, b]) => `${x(a)},${y(Math.max(b, ylo))}`);
  svg.append(el("polyline", { class: "roof", points: roof.join(" ") },
    el("title", {}, `${fmtNumber(peak)} TFLOP/s (${dtype}), ${fmtNumber(tbps)} TB/s`)));
  svg.append(el("text", { x: W - right, y: y(peak) - 4, "text-anchor": "end" }, `${fmtNumber(peak)} TFLOP/s`));
  svg.append(el("text", { x: W / 2, y: H - 4, "text-anchor": "middle" }, "flop / byte"));
  svg.append(el("text", { x: 2, y: 10 }, "TFLOP/s"));
  const names = [...new Set(layers.map((r) => r.layer))];
  for (const { r, ai } of pts) {
    const color = COLORS[names.indexOf(r.layer) % COLORS.length];
    const share = (100 * r.tflops) / Math.min(peak, ai * tbps);
    svg.append(el("circle", { cx: x(ai), cy: y(r.tflops), r: 4, fill: color, "fill-opacity": 0.8 },
      el("title", {}, `${r.layer} M=${r.M}: ${fmtNumber(r.tflops)} TFLOP/s, ${fmtNumber(r.gbps)} GB/s, ` +
        `${fmtShare(share)}% of the roof`)));
  }
  if (!pts.length) svg.append(el("text", { x: left + 10, y: H / 2 }, "no layer timings since reset"));
  return svg;
}

function layerTable(layers, peaks, choices) {
  const showChoice = choices && Object.keys(choices).length > 0;
  const names = [...new Set(layers.map((r) => r.layer))];
  const head = ["layer", "kernel", "M (bucket)", "N × K", showChoice ? "choice" : null, "calls", "time p50",
    "p99", "TFLOP/s", "GB/s", "% of roof", "config"].filter((h) => h !== null);
  const table = el("table", { "data-table": "layers" }, el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))));
  const body = el("tbody");
  for (const r of layers) {
    const ai = r.gbps > 0 ? (1e3 * r.tflops) / r.gbps : 0;
    const roof = Math.min(peaks.tflops[r.dtype] || peaks.tflops.float32, ai * peaks.tbps);
    const choice = showChoice ? choices[String(r.M)] || "–" : null;
    const swatch = el("span", { class: "swatch", style: `background:${COLORS[names.indexOf(r.layer) % COLORS.length]}` });
    body.append(el("tr", {},
      el("td", {}, swatch, r.layer), el("td", {}, r.kernel), el("td", {}, r.M), el("td", {}, `${r.N} × ${r.K}`),
      showChoice ? el("td", { class: "choice-" + choice }, choice) : null,
      el("td", { "data-field": "calls" }, fmtNumber(r.calls)), el("td", {}, fmtSeconds(r.p50_s)),
      el("td", {}, fmtSeconds(r.p99_s)), el("td", {}, fmtNumber(r.tflops)), el("td", {}, fmtNumber(r.gbps)),
      el("td", {}, roof > 0 ? fmtShare((100 * r.tflops) / roof) : "–"), el("td", { class: "config" }, r.config || "–")));
  }
  table.append(body);
  return table;
}

function deviceTable(name, byDevice) {
  // One engine per device (--devices): each one's figures for this model; the section's are the totals.
  const head = ["device", "requests", "requests / s", "latency p50", "p99", "queue depth (rows)", "errors by status"];
  const body = el("tbody");
  for (const [device, stats] of Object.entries(byDevice)) {
    const m = stats.models[name];
    if (!m) continue;
    const errors = Object.entries(m.errors_by_status).map(([s, n]) => `${s} ×${n}`).join("  ") || "none";
    body.append(el("tr", { "data-device": device }, el("td", {}, device),
      el("td", { "data-field": "requests" }, fmtNumber(m.requests)), el("td", {}, fmtNumber(m.requests_per_s)),
      el("td", {}, fmtSeconds(m.latency.p50_s)), el("td", {}, fmtSeconds(m.latency.p99_s)),
      el("td", {}, fmtNumber(m.queued_rows)), el("td", {}, errors)));
  }
  return el("table", { "data-table": "devices" }, el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))), body);
}

function renderModel(name, model, kernels, now, devices, byDevice) {
  const served = kernels.served[name] || {};
  const kernel = kernels.models[name];
  const layers = kernels.layers.filter((r) => r.model === name);
  // Served on several devices, the totals' roof is the first one's ("cuda:0,cuda:1").
  const peaks = devices[model.device] || devices[model.device.split(",")[0]];
  const section = el("section", { class: "model", "data-model": name },
    el("h2", {}, name),
    el("div", { class: "meta" }, `${model.in_features} → ${model.out_features} · ${model.dtype} · ` +
      `${model.backend} backend · ${model.device}`),
    renderFigures(name, model, kernel, now),
    byDevice ? [el("h3", {}, "by device"), deviceTable(name, byDevice)] : null,
    el("div", { class: "charts" },
      el("div", {}, el("h3", {}, "batch sizes"), histogram(kernel && kernel.batch_size_histogram)),
      el("div", {}, el("h3", {}, `roofline (${peaks.name})`), roofline(layers, peaks, model.dtype))),
    el("h3", {}, "layers"));
  section.append(layers.length ? layerTable(layers, peaks, served.choices)
    : el("p", { class: "empty" }, "no layer timings since reset: send some requests"));
  return section;
}

// ---- the page --------------------------------------------------------------------------------
function renderDevices(devices) {
  const box = document.getElementById("devices");
  box.replaceChildren(...Object.entries(devices).map(([device, p]) => {
    const rates = [...new Set(Object.values(p.tflops))].length === 1
      ? `${fmtNumber(Object.values(p.tflops)[0])} TFLOP/s (any dtype)`
      : Object.entries(p.tflops).map(([d, t]) => `${fmtNumber(t)} TFLOP/s ${d}`).join(", ");
    return el("p", { "data-device": device }, el("strong", {}, p.name),
      ` (${device}): roof ${rates}, ${fmtNumber(p.tbps)} TB/s. `,
      el("span", { class: p.estimate ? "estimate" : "" }, p.source));
  }));
}

function render(models, kernels) {
  const now = Date.now();
  renderDevices(models.devices);
  const names = Object.keys(models.models);
  const main = document.getElementById("models");
  main.replaceChildren(...names.map((n) => renderModel(n, models.models[n], kernels, now, models.devices,
    models.by_device)));
  if (!names.length) main.append(el("p", { class: "empty" }, "no models loaded yet"));
  const stray = models.unattributed;
  if (stray.requests) main.append(el("p", { class: "meta", "data-field": "unattributed" },
    `refused before a model was known: ${Object.entries(stray.errors_by_status).map(([s, n]) => `${s} ×${n}`).join("  ")}`));
  page.previous = { t: now, models: Object.fromEntries(names.map((n) => [n, models.models[n].requests])) };
  setStatus(`updated ${new Date(now).toLocaleTimeString("en-GB")} · ${names.length} models · ` +
    `${fmtNumber(models.window_s, 2)} s since reset`);
}

function setStatus(text, error = false) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.classList.toggle("error", error);
}

async function poll(once = false) {
  // One chain of polls: a newer call (reset, a new interval) supersedes any answer still on its way.
  clearTimeout(page.timer);
  const run = ++page.run;
  if ((page.paused && !once) || page.waitingForKey) return;
  try {
    const [models, kernels] = await Promise.all([api("model-stats"), api("kernel-stats")]);
    if (run !== page.run) return;
    render(models, kernels);
  } catch (e) {
    if (e instanceof KeyNeeded || run !== page.run) return; // polling resumes once a key is entered
    setStatus(`cannot read the stats: ${e.message}`, true);
  }
  if (!page.paused) page.timer = setTimeout(poll, Number(document.getElementById("interval").value));
}

async function reset() {
  try {
    await api("kernel-stats/reset", { method: "POST" });
    page.previous = null;
    poll(true);
  } catch (e) {
    if (!(e instanceof KeyNeeded)) setStatus(`reset failed: ${e.message}`, true);
  }
}

function start() {
  document.getElementById("reset").addEventListener("click", reset);
  document.getElementById("interval").addEventListener("change", () => poll());
  document.getElementById("pause").addEventListener("click", (e) => {
    page.paused = !page.paused;
    e.target.textContent = page.paused ? "Resume" : "Pause";
    if (page.paused) clearTimeout(page.timer);
    else poll();
  });
  document.getElementById("auth").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY_STORE, document.getElementById("key").value);
    document.getElementById("auth").hidden = true;
    page.waitingForKey = false;
    poll();
  });
  poll();
}

start();
