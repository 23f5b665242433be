// graphline operator dashboard: polls /status and renders ranks, plans, capture times, graph memory,
// path counts, eager reasons, padding waste, resets, prefix cache and chunked prefill counters.
// No dependencies; DOM built with textContent only.
"use strict";

const POLL_MS = 1000;
const rateHistory = [];
let last = null;

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function bytes(n) {
  n = Number(n || 0);
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n.toFixed(0)) + " " + u[i];
}

function num(n) { return Number(n || 0).toLocaleString("en-US"); }
function secs(s) { return Number(s || 0).toFixed(2); }
function pct(x) { return (100 * Number(x || 0)).toFixed(1) + " %"; }
function duration(s) {
  s = Math.floor(s || 0);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return (h ? h + "h " : "") + (h || m ? m + "m " : "") + (s % 60) + "s";
}

function buckets(kindMap) {
  return Object.keys(kindMap || {}).filter((b) => (kindMap[b] || {}).graph !== false)
    .map(Number).sort((a, b) => a - b);
}

function rankRow(r) {
  const cap = r.capture || {}, mem = r.memory || {}, steps = r.steps || {};
  const dec = buckets(cap.decode), pre = buckets(cap.prefill);
  const reasons = el("td", { class: "eager-reasons" });
  const entries = Object.entries(r.eager_reasons || {}).sort((a, b) => b[1] - a[1]);
  if (!entries.length) reasons.append(el("span", { class: "muted" }, "none"));
  for (const [k, v] of entries) reasons.append(el("span", { class: "reason", "data-reason": k }, k + " " + num(v)));
  const alive = r.alive !== false;
  const kv = (r.kv_blocks != null ? num(r.kv_blocks) + " blk" + (r.kv_bytes != null ? " / " + bytes(r.kv_bytes) : "") : "-") +
    (r.memory_allocated != null ? " · device " + bytes(r.memory_allocated) : "");
  return el("tr", { class: "rank", "data-rank": r.rank, id: "rank-" + r.rank },
    el("td", { class: "rank-id" }, "rank " + r.rank),
    el("td", {}, `${r.dp_rank ?? "-"} / ${r.tp_rank ?? "-"} / ${r.ep_rank ?? "-"}`),
    el("td", { class: "device" }, (r.node ? r.node + " " : "") + (r.device || "-")),
    el("td", { class: alive ? "up" : "down" }, alive ? "up" : "DOWN"),
    el("td", { class: "decode-graphs", title: dec.join(", ") }, num(cap.decode_graphs ?? dec.length),
      el("div", { class: "muted" }, dec.length ? dec.join(" ") : "-")),
    el("td", { class: "prefill-plans", title: pre.join(", ") }, num(cap.prefill_plans ?? pre.length),
      el("div", { class: "muted" }, pre.length ? pre.join(" ") : "-")),
    el("td", { class: "capture-s num" }, secs(cap.decode_seconds_total) + " / " + secs(cap.prefill_seconds_total)),
    el("td", { class: "graph-memory num" }, bytes(mem.decode_graph_pool_bytes) + " / " + bytes(mem.piecewise_graph_pool_bytes)),
    el("td", { class: "bridge-bytes num" }, bytes(mem.bridge_bytes)),
    el("td", { class: "path-steps num" },
      el("span", { class: "steps-full_graph" }, num(steps.full_graph)), " / ",
      el("span", { class: "steps-piecewise" }, num(steps.piecewise)), " / ",
      el("span", { class: "steps-eager" }, num(steps.eager))),
    reasons,
    el("td", { class: "padding-waste num" }, pct(r.padding_waste)),
    el("td", { class: "lane-armed num", title: "decode lane steps / armed steps taken / armed steps cancelled" },
      num(r.decode_lane_steps ?? 0) + " / " +
      (r.armed_decode ? num(r.armed_decode.went) + " / " + num(r.armed_decode.cancelled) : "off")),
    el("td", { class: "kv num" }, kv),
    el("td", { class: "rank-resets num" }, num(r.resets)),
  );
}

function captureDetail(ranks) {
  const box = $("capture-detail");
  box.replaceChildren();
  let max = 0;
  for (const r of ranks) for (const k of ["decode", "prefill"])
    for (const v of Object.values((r.capture || {})[k] || {})) max = Math.max(max, Number(v.seconds || 0));
  let any = false;
  for (const r of ranks) {
    for (const k of ["decode", "prefill"]) {
      const m = (r.capture || {})[k] || {};
      for (const b of Object.keys(m).map(Number).sort((a, c) => c - a)) {
        any = true;
        const s = Number(m[b].seconds || 0);
        box.append(el("div", { class: "bucket" },
          el("span", {}, `rank ${r.rank} ${k} ${b}` + (m[b].graph === false ? " (eager)" : "")),
          el("span", {}, el("span", { class: "bar", style: `width:${max ? Math.max(2, 100 * s / max) : 2}%` })),
          el("span", { class: "num" }, (1000 * s).toFixed(1) + " ms")));
      }
    }
  }
  if (!any) box.append(el("span", { class: "muted" }, "no graphs captured (eager or CPU)"));
}

function logList(id, items, fmt) {
  const ol = $(id);
  ol.replaceChildren();
  if (!items || !items.length) { ol.append(el("li", { class: "muted" }, "none")); return; }
  for (const it of items.slice(-20).reverse()) ol.append(el("li", {}, fmt(it)));
}

function when(t) { return t ? new Date(t * 1000).toLocaleTimeString() : ""; }

function sparkline(values) {
  const c = $("spark"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  if (values.length < 2) return;
  const max = Math.max(1, ...values);
  g.strokeStyle = "#58a6ff"; g.lineWidth = 1.5; g.beginPath();
  values.forEach((v, i) => {
    const x = (i / (values.length - 1)) * (c.width - 2) + 1, y = c.height - 2 - (v / max) * (c.height - 4);
    i ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.stroke();
}

function render(st) {
  const dep = st.deployment || {}, eng = st.engine || {}, ranks = st.ranks || [];
  $("model").textContent = "model " + (st.model || "?");
  $("topology").textContent = `tp ${dep.tp ?? "?"} · dp ${dep.dp ?? "?"} · ep ${dep.ep ?? "?"}`;
  $("executor").textContent = "executor " + (dep.executor || "?") + (dep.eager ? " (eager)" : "");
  $("state").textContent = "state " + (st.state || "?");
  const phases = Object.entries(st.phases || {});
  $("phases").textContent = phases.length ? phases.map(([k, v]) => k + " " + num(v)).join(" · ") : "-";
  const ov = st.overhead || {};
  $("overhead").textContent = ov.coordinator_ms_mean != null ? Number(ov.coordinator_ms_mean).toFixed(2) + " ms" : "-";
  $("step-path").textContent = (st.step_path ? "step path " + st.step_path : "") +
    (ov.in_rank_step_ms_mean != null ? " · in-rank " + Number(ov.in_rank_step_ms_mean).toFixed(2) + " ms" : "");
  const ok = st.health === "ok";
  const h = $("health");
  h.textContent = ok ? "healthy" : "unhealthy: " + st.health;
  h.className = "pill badge " + (ok ? "ok" : "bad");
  $("uptime").textContent = "up " + duration(st.uptime_s);
  const adm = st.admission || {};
  $("in-flight").textContent = num(adm.in_flight ?? eng.in_flight) + (adm.max_in_flight ? " / " + num(adm.max_in_flight) : "");
  $("queue").textContent = num(eng.waiting) + " / " + num(eng.running);
  $("generated").textContent = num(eng.generated_tokens);
  $("steps-total").textContent = num(eng.steps);
  $("preemptions").textContent = num(eng.preemptions);
  const pc = eng.prefix_cache || {};
  $("prefix-hit-rate").textContent = pc.enabled === false ? "off" : pct(pc.hit_rate);
  $("prefix-tokens").textContent = num(pc.hits) + " / " + num(pc.queries) + " prompt tokens";
  const shared = (eng.dp_ranks || []).reduce((a, d) => a + (d.shared_kv_blocks || 0), 0);
  $("prefix-blocks").textContent = num(pc.cached_blocks) + " / " + num(shared);
  $("prefix-evictions").textContent = num(pc.evictions) + " evictions";
  $("prefill-chunks").textContent = num(eng.prefill_chunks);
  const lim = eng.limits || {};
  $("chunk-mode").textContent = eng.chunked_prefill ? "chunked, " + num(lim.max_num_batched_tokens) + " tokens / step"
    : "whole prompts";
  $("resets-count").textContent = num(st.num_resets ?? eng.resets);
  $("failures-count").textContent = num(Math.max(st.num_failures || 0, eng.executor_failures || 0));
  const dps = eng.dp_ranks || [];
  const used = dps.reduce((a, d) => a + (d.num_kv_blocks - 1 - d.free_kv_blocks), 0);
  const total = dps.reduce((a, d) => a + (d.num_kv_blocks - 1), 0);
  $("kv-usage").textContent = total ? pct(used / total) : "-";
  if (last && st.time > last.time) {
    const rate = ((eng.generated_tokens || 0) - ((last.engine || {}).generated_tokens || 0)) / (st.time - last.time);
    rateHistory.push(Math.max(0, rate));
    if (rateHistory.length > 120) rateHistory.shift();
    $("tok-rate").textContent = rate.toFixed(1);
    sparkline(rateHistory);
  }
  last = st;
  $("rank-count").textContent = `(${ranks.length})`;
  const body = $("rank-rows");
  body.replaceChildren(...(ranks.length ? ranks.map(rankRow)
    : [el("tr", {}, el("td", { colspan: 14, class: "muted" }, "no ranks reported"))]));
  captureDetail(ranks);
  logList("reset-list", st.resets, (r) => typeof r === "object"
    ? `${when(r.time)} ${Object.entries(r).filter(([k]) => k !== "time").map(([k, v]) =>
        k + "=" + (typeof v === "number" ? v.toFixed(3) : JSON.stringify(v))).join(" ")}` : String(r));
  logList("failure-list", st.failures, (f) => typeof f === "object" ? `${when(f.time)} ${f.message || JSON.stringify(f)}` : String(f));
  $("last-update").textContent = "updated " + new Date().toLocaleTimeString();
  $("error").textContent = "";
  adminAuth = !!st.admin_auth;
  document.body.dataset.ranks = String(ranks.length);
  document.body.dataset.loaded = "1";
}

async function poll() {
  try {
    const r = await fetch("/status", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    $("error").textContent = "status unavailable: " + e.message;
    const h = $("health");
    h.textContent = "unreachable"; h.className = "pill badge bad";
  }
}

// ---- admin reset. With an admin token configured (`/status` says admin_auth), the page asks for it once
// (window.prompt), keeps it in this tab's sessionStorage and sends it as `Authorization: Bearer ...`;
// a 401 forgets it and asks again once.
const TOKEN_KEY = "graphline.adminToken";
let adminAuth = false;

function resetMessage(text, kind) {
  const m = $("reset-msg");
  m.textContent = text;
  m.className = "reset-msg " + (kind || "");
}

function askToken(why) {
  const t = window.prompt(why + " Enter the admin token (kept for this tab only):", "");
  if (t === null || !t.trim()) return null;
  sessionStorage.setItem(TOKEN_KEY, t.trim());
  return t.trim();
}

function postReset(token) {
  const headers = { "Content-Type": "application/json" };
  if (token) headers["Authorization"] = "Bearer " + token;
  return fetch("/admin/reset", { method: "POST", headers, body: "{}", cache: "no-store" });
}

async function resetAll() {
  if (!confirm("Drain, reset and re-capture every rank? In-flight requests pause and resume.")) return;
  const b = $("reset-btn");
  b.disabled = true;
  resetMessage("resetting ...", "");
  try {
    let token = sessionStorage.getItem(TOKEN_KEY);
    if (!token && adminAuth) token = askToken("This server protects /admin/* with a token.");
    if (adminAuth && !token) { resetMessage("reset cancelled: it needs the admin token", "bad"); return; }
    let r = await postReset(token);
    if (r.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      token = askToken(token ? "The admin token was rejected (401)." : "This server needs an admin token (401).");
      if (token) r = await postReset(token);
    }
    if (r.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      resetMessage("reset refused (401 Unauthorized): the admin token is missing or wrong", "bad");
      return;
    }
    const j = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error((j.error || {}).message || ("HTTP " + r.status));
    const wall = (j.result || {}).wall_s;
    resetMessage("reset done" + (wall != null ? " in " + Number(wall).toFixed(2) + " s" : ""), "ok");
  } catch (e) {
    resetMessage("reset failed: " + e.message, "bad");
  } finally {
    b.disabled = false;
    poll();
  }
}

$("reset-btn").addEventListener("click", resetAll);
poll();
setInterval(() => { if ($("live").checked) poll(); }, POLL_MS);
