// The live page of the driver's exchanges: polls api/state once a second and draws each exchange as Flink's web
// UI draws a job graph (vertices coloured by back-pressure status, the partitioner on the edge), its subtasks,
// where backpressure starts, the diagnosis once it ended, and charts of the samples. No library: plain DOM and SVG.
"use strict";

const POLL_MS = 1000;
const SIDES = ["producer", "consumer"];
const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf"];
const opened = {};  // "<exchange>/<side>" -> whether its subtasks are listed
let focused = decodeURIComponent(location.hash.slice(1));
let scrolled = false;

function esc(value) {
  return String(value).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;",
    "'": "&#39;"}[c]));
}

function num(value, digits) {
  if (value === null || value === undefined) return "–";
  return Number(value).toLocaleString("en-US", {maximumFractionDigits: digits || 0});
}

function bytes(value) {
  if (value === null || value === undefined) return "–";
  if (value >= 1e6) return num(value / 1e6, 2) + " MB";
  if (value >= 1e3) return num(value / 1e3, 1) + " kB";
  return num(value) + " B";
}

function statusClass(status) {
  return "status-" + (status || "none");
}

function vertexName(ex, side) {
  if (side === "producer") {
    const chained = ex.before.length ? " → " + ex.before.join(" → ") : "";
    return "Producers" + chained;
  }
  return "Consumers" + (ex.after.length ? " → " + ex.after.join(" → ") : "");
}

function graph(ex) {
  const w = 820, h = 150, vw = 320, vh = 110, y = 20;
  const xs = {producer: 20, consumer: w - vw - 20};
  let svg = `<svg class="graph" viewBox="0 0 ${w} ${h}" role="img" aria-label="job graph of ${esc(ex.name)}">`;
  svg += `<defs><marker id="arrow-${esc(ex.name)}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8"
    markerHeight="8" orient="auto"><path d="M0,0 L10,5 L0,10 z" class="arrowhead"/></marker></defs>`;
  const x1 = xs.producer + vw, x2 = xs.consumer, ym = y + vh / 2;
  svg += `<line class="edge" x1="${x1}" y1="${ym}" x2="${x2 - 2}" y2="${ym}" marker-end="url(#arrow-${esc(ex.name)})"/>`;
  svg += `<text class="edge-label" x="${(x1 + x2) / 2}" y="${ym - 10}" text-anchor="middle">${esc(ex.partitioner)}</text>`;
  svg += `<text class="edge-mode" x="${(x1 + x2) / 2}" y="${ym + 22}" text-anchor="middle">${esc(ex.mode)}</text>`;
  for (const side of SIDES) {
    const v = ex.vertices[side];
    const x = xs[side];
    const origin = side === "consumer" ? originOf(ex) : null;
    svg += `<g class="vertex" data-side="${side}" data-status="${esc(v.status || "none")}" tabindex="0">`;
    svg += `<rect class="${statusClass(v.status)}" x="${x}" y="${y}" width="${vw}" height="${vh}" rx="6"/>`;
    svg += `<text class="vertex-name" x="${x + 12}" y="${y + 24}">${esc(vertexName(ex, side))}</text>`;
    svg += `<text x="${x + 12}" y="${y + 46}">Parallelism: ${v.parallelism}</text>`;
    svg += `<text class="vertex-status" x="${x + 12}" y="${y + 68}">Back pressure: ${esc(v.status || "–")}` +
      ` (max ${num(v.back_pressured_max)} ms/s)</text>`;
    if (origin !== null) {
      const what = ex.diagnosis ? `diagnosis: ${ex.diagnosis.verdict} at subtask` : "backpressure starts at subtask";
      svg += `<text class="vertex-origin" x="${x + 12}" y="${y + 92}">${esc(what)} ${origin}</text>`;
    }
    svg += "</g>";
  }
  return svg + "</svg>";
}

function originOf(ex) {
  if (ex.origin && ex.origin.kind === "consumer") return ex.origin.subtask;
  if (ex.diagnosis && ex.diagnosis.origin !== null && ex.diagnosis.verdict !== "ok") return ex.diagnosis.origin;
  return null;
}

function channelsText(channels, side) {
  if (!channels.length) return "–";
  const names = side === "producer" ? ["backlog", "credit", "outputQueueLength"] :
    ["credit", "backlog", "unannouncedCredit", "inputQueueLength"];
  return channels.map((c) => {
    const parts = names.filter((n) => c[n] !== undefined).map((n) => `${n} ${num(c[n])}`);
    return `<span class="channel">${side === "producer" ? "→" : "←"}${c.channel}: ${parts.join(", ")}</span>`;
  }).join("");
}

function table(ex, side) {
  const v = ex.vertices[side];
  const key = ex.name + "/" + side;
  const open = key in opened ? opened[key] : v.parallelism <= 8;
  const origin = side === "consumer" ? originOf(ex) : null;
  const dir = side === "producer" ? "out" : "in";
  const last = ex.state === "finished" ? " (last sample)" : "";
  let html = `<details class="subtasks" data-side="${side}" data-key="${esc(key)}"${open ? " open" : ""}>`;
  html += `<summary>${esc(vertexName(ex, side))}: ${v.parallelism} subtasks</summary><table><thead><tr>` +
    `<th>subtask</th><th>back pressure</th><th>records ${dir}</th><th>buffers ${dir}</th><th>bytes ${dir}</th>` +
    `<th>busy ms/s</th><th>idle ms/s</th><th>back-pressured ms/s</th><th>pool usage${last}</th><th>records/s</th>` +
    `<th>channels${last}</th></tr></thead><tbody>`;
  for (const s of v.subtasks) {
    const pools = Object.entries(s.pools).map(([n, u]) => `<span class="pool">${n} ${num(u, 2)}</span>`).join("") ||
      "–";
    const mark = s.subtask === origin ? " origin" : "";
    html += `<tr class="${statusClass(s.status)}${mark}" data-subtask="${s.subtask}">` +
      `<td>${s.subtask}${s.executor ? `<br><small>${esc(s.executor)}</small>` : ""}</td>` +
      `<td class="badge">${esc(s.status || "–")}</td><td>${num(s.records)}</td><td>${num(s.buffers)}</td>` +
      `<td>${bytes(s.bytes)}</td><td>${num(s.busyTimeMsPerSecond)}</td><td>${num(s.idleTimeMsPerSecond)}</td>` +
      `<td>${num(s.backPressuredTimeMsPerSecond)}</td><td>${pools}</td><td>${num(s.rate)}</td>` +
      `<td>${channelsText(s.channels, side)}</td></tr>`;
  }
  return html + "</tbody></table></details>";
}

function chart(ex, title, metrics, yMax, bands) {
  const w = 520, h = 180, left = 48, right = 10, top = 24, bottom = 22;
  const lines = [];
  let t0 = Infinity, t1 = -Infinity, top_ = yMax || 0;
  for (const side of SIDES) {
    const metric = metrics[side];
    for (let i = 0; i < ex.vertices[side].parallelism; i++) {
      const points = ex.history[`${side}/${i}/${metric}`];
      if (!points || !points.length) continue;
      for (const [t, v] of points) {
        t0 = Math.min(t0, t); t1 = Math.max(t1, t);
        if (!yMax) top_ = Math.max(top_, v);
      }
      lines.push({side, subtask: i, points});
    }
  }
  let svg = `<svg class="chart" viewBox="0 0 ${w} ${h}" role="img" aria-label="${esc(title)}">` +
    `<text class="chart-title" x="${left}" y="14">${esc(title)}</text>`;
  if (!lines.length) return svg + `<text class="chart-empty" x="${left}" y="${h / 2}">no samples yet</text></svg>`;
  top_ = top_ > 0 ? top_ : 1;
  const span = Math.max(t1 - t0, 1);
  const px = (t) => left + (t - t0) / span * (w - left - right);
  const py = (v) => top + (1 - Math.min(v, top_) / top_) * (h - top - bottom);
  for (const [from, to, cls] of bands || []) {
    svg += `<rect class="band ${cls}" x="${left}" y="${py(Math.min(to, top_))}" width="${w - left - right}"` +
      ` height="${Math.max(py(from) - py(Math.min(to, top_)), 0)}"/>`;
  }
  svg += `<line class="axis" x1="${left}" y1="${h - bottom}" x2="${w - right}" y2="${h - bottom}"/>` +
    `<line class="axis" x1="${left}" y1="${top}" x2="${left}" y2="${h - bottom}"/>` +
    `<text class="tick" x="${left - 4}" y="${top + 4}" text-anchor="end">${num(top_, top_ < 10 ? 2 : 0)}</text>` +
    `<text class="tick" x="${left - 4}" y="${h - bottom}" text-anchor="end">0</text>` +
    `<text class="tick" x="${w - right}" y="${h - 6}" text-anchor="end">${num(span / 1000, 1)} s</text>`;
  for (const line of lines) {
    const colour = COLOURS[line.subtask % COLOURS.length];
    const d = line.points.map(([t, v]) => `${px(t).toFixed(1)},${py(v).toFixed(1)}`).join(" ");
    svg += `<polyline class="series ${line.side}" stroke="${colour}" points="${d}"><title>${line.side} ` +
      `${line.subtask}</title></polyline>`;
  }
  return svg + "</svg>";
}

function legend(ex) {
  const count = Math.max(ex.vertices.producer.parallelism, ex.vertices.consumer.parallelism);
  let html = '<p class="legend">producers solid, consumers dashed; subtask: ';
  for (let i = 0; i < Math.min(count, COLOURS.length); i++) {
    html += `<span class="swatch swatch-${i}">${i}</span>`;
  }
  return html + "</p>";
}

function exchangeHtml(ex) {
  const elapsed = ex.first_ms && ex.last_ms ? ` · ${num((ex.last_ms - ex.first_ms) / 1000, 1)} s of samples` : "";
  const started = new Date(ex.created_ms).toLocaleTimeString();
  let html = `<h2>${esc(ex.name)} <span class="state state-${esc(ex.state)}">${esc(ex.state)}</span></h2>` +
    `<p class="meta">${esc(ex.mode)} · ${ex.vertices.producer.parallelism} → ${ex.vertices.consumer.parallelism}` +
    ` subtasks · planned ${esc(started)}${elapsed}</p>`;
  html += graph(ex);
  if (ex.origin) {
    html += `<p class="origin" data-kind="${esc(ex.origin.kind)}" data-subtask="${esc(ex.origin.subtask)}">` +
      `Now: ${esc(ex.origin.text)}</p>`;
  }
  if (ex.diagnosis) {
    html += `<p class="diagnosis" data-verdict="${esc(ex.diagnosis.verdict)}">Diagnosis: ` +
      `${esc(ex.diagnosis.text)}</p>`;
  }
  html += '<div class="tables">' + SIDES.map((side) => table(ex, side)).join("") + "</div>";
  html += legend(ex) + '<div class="charts">' +
    chart(ex, "Back-pressured ms/s (backPressuredTimeMsPerSecond), OK / LOW / HIGH",
      {producer: "backPressuredTimeMsPerSecond", consumer: "backPressuredTimeMsPerSecond"}, 1000,
      [[0, 100, "band-OK"], [100, 500, "band-LOW"], [500, 1000, "band-HIGH"]]) +
    chart(ex, "Busy ms/s (busyTimeMsPerSecond)",
      {producer: "busyTimeMsPerSecond", consumer: "busyTimeMsPerSecond"}, 1000) +
    chart(ex, "Pool usage (outPoolUsage, inPoolUsage)", {producer: "outPoolUsage", consumer: "inPoolUsage"}, 1) +
    chart(ex, "Records per second (numRecordsOut/InPerSecond)",
      {producer: "numRecordsOutPerSecond", consumer: "numRecordsInPerSecond"}, 0) +
    "</div>";
  return html;
}

function render(state) {
  const main = document.getElementById("exchanges");
  if (!state.exchanges.length) return;
  const empty = main.querySelector(".empty");
  if (empty) empty.remove();
  const seen = new Set();
  let previous = null;
  for (const ex of state.exchanges) {
    const id = "exchange-" + ex.name;
    seen.add(id);
    let section = document.getElementById(id);
    if (!section) {
      section = document.createElement("section");
      section.id = id;
      section.className = "exchange";
      section.dataset.exchange = ex.name;
      section.addEventListener("toggle", (event) => {
        const d = event.target;
        if (d.dataset && d.dataset.key) opened[d.dataset.key] = d.open;
      }, true);
      section.addEventListener("click", (event) => {
        const vertex = event.target.closest(".vertex");
        if (!vertex) return;
        const details = section.querySelector(`details[data-side="${vertex.dataset.side}"]`);
        if (details) details.open = !details.open;
      });
    }
    if (previous ? previous.nextSibling !== section : main.firstChild !== section) {
      main.insertBefore(section, previous ? previous.nextSibling : main.firstChild);
    }
    previous = section;
    section.dataset.state = ex.state;
    section.classList.toggle("focused", ex.name === focused);
    section.innerHTML = exchangeHtml(ex);
  }
  for (const section of Array.from(main.querySelectorAll("section.exchange"))) {
    if (!seen.has(section.id)) section.remove();
  }
  if (focused && !scrolled) {
    const target = document.getElementById("exchange-" + focused);
    if (target) { target.scrollIntoView(); scrolled = true; }
  }
}

async function poll() {
  const connection = document.getElementById("connection");
  try {
    const answer = await fetch("api/state", {cache: "no-store"});
    if (!answer.ok) throw new Error("HTTP " + answer.status);
    render(await answer.json());
    connection.textContent = "live · " + new Date().toLocaleTimeString();
    connection.className = "connection live";
  } catch (error) {
    connection.textContent = "no answer from the driver (" + error.message + ")";
    connection.className = "connection lost";
  }
  setTimeout(poll, POLL_MS);
}

window.addEventListener("hashchange", () => { focused = decodeURIComponent(location.hash.slice(1)); scrolled = false; });
poll();
