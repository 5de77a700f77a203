// The status page: the Host's REST API, read once a second.
"use strict";

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
const badge = (s) => el("span", { class: "badge " + s }, s);
const when = (t) => (t && !t.startsWith("0001")) ? new Date(t).toLocaleTimeString() : "–";
const ms = (s) => s ? (s * 1000).toFixed(1) + " ms" : "–";
const mib = (b) => (b / 1048576).toFixed(1) + " MiB";
// The KV a migration sent, and what shared prompt prefixes saved it.
function moved(m) {
  if (!m.data_size_bytes) return "–";
  const saved = (m.rounds || []).reduce((n, r) => n + (r.shared_bytes_saved || 0), 0);
  return mib(m.data_size_bytes) + (saved ? " (" + mib(saved) + " shared, sent once)" : "");
}

function fill(id, rows, empty) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colspan: "10" }, empty))]));
}

function kvBar(st) {
  const total = st.total_blocks || 0, used = total - (st.free_blocks || 0);
  const pct = total ? Math.round(100 * used / total) : 0;
  const fill = el("i");
  fill.style.width = pct + "%"; // through the CSSOM: the page's CSP allows no inline style attribute
  const bar = el("span", { class: "bar" }, fill);
  return el("td", {}, bar, total ? pct + " %" : "–");
}

async function get(path) {
  const r = await fetch(path, { headers: { Accept: "application/json" } });
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

async function refresh() {
  try {
    const [status, inst, migs, drains, scales] = await Promise.all([
      get("/vllm_hi/status"), get("/vllm_hi/instances"), get("/vllm_hi/migrations"),
      get("/vllm_hi/drains"), get("/vllm_hi/scales"),
    ]);
    document.getElementById("summary").textContent =
      status.instance_count + " instances · models: " + (status.models || []).join(", ") + " · " + status.version;
    fill("instances", (inst.instances || []).map((i) => el("tr", { "data-id": i.vllm_hi_id },
      el("td", {}, i.vllm_hi_id), el("td", {}, i.served_model_name), el("td", {}, badge(i.role)),
      el("td", {}, badge(i.lifecycle)), kvBar(i.stats || {}), el("td", {}, (i.stats || {}).num_running || 0),
      el("td", {}, (i.stats || {}).num_waiting || 0), el("td", {}, "TP" + i.tp + "×PP" + i.pp), el("td", {}, i.engine_url))),
      "no instances registered");
    const switched = status.switched_models || {};
    document.getElementById("switched").hidden = Object.keys(switched).length === 0;
    fill("models", Object.keys(switched).sort().map((a) => el("tr", { "data-id": a },
      el("td", {}, a), el("td", {}, badge(switched[a].state)), el("td", {}, switched[a].group || "–"),
      el("td", {}, switched[a].active), el("td", {}, switched[a].queued))), "no switched models");
    fill("migrations", (migs.migrations || []).slice(0, 20).map((m) => el("tr", { "data-id": m.migration_id },
      el("td", {}, m.migration_id), el("td", {}, badge(m.state)), el("td", {}, m.current_step),
      el("td", {}, m.src_vllm_hi_id + " → " + m.dst_vllm_hi_id), el("td", {}, m.migration_type),
      el("td", {}, (m.migrated_request_count || 0) + "/" + (m.request_count || 0)), el("td", {}, ms(m.downtime_s)),
      el("td", {}, moved(m)),
      el("td", { class: "steps" }, (m.step_history || []).map((s) => s.step + " " + ms(s.duration_s)).join(" · ")),
      el("td", {}, when(m.created_at)))), "no migrations yet");
    fill("drains", (drains.drains || []).slice(0, 20).map((d) => el("tr", {},
      el("td", {}, d.drain_id), el("td", {}, d.vllm_hi_id), el("td", {}, badge(d.state)), el("td", {}, d.moved),
      el("td", {}, d.remaining), el("td", {}, when(d.created_at)))), "no drains yet");
    fill("scales", (scales.scales || []).slice(0, 20).map((s) => el("tr", {},
      el("td", {}, s.scale_id), el("td", {}, s.model), el("td", {}, s.kind), el("td", {}, badge(s.state)),
      el("td", {}, s.from + " → " + s.to), el("td", { class: "steps" }, (s.phases || []).map((p) => p.phase).join(" · ")),
      el("td", {}, when(s.started_at)))), "no scaling yet");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("updated").textContent = "cannot reach the Host: " + e.message;
  }
}

refresh();
setInterval(refresh, 1000);
