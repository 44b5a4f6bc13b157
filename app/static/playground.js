// Remask playground: sends a streamed chat request with stream_options.include_canvas and draws the
// canvas round by round; polls /debug/cluster for the cluster panel. Plain JavaScript, no dependencies.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "remask.playground.apiKey";
  const CLUSTER_EVERY_MS = 1000;

  // ---- small helpers -------------------------------------------------------------------------
  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function authHeaders(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = $("api-key").value.trim();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  async function errorText(resp) {
    let detail = "";
    try {
      const body = await resp.json();
      detail = (body && body.error && body.error.message) || JSON.stringify(body);
    } catch (_) {
      detail = resp.statusText || "";
    }
    return "HTTP " + resp.status + (detail ? ": " + detail : "");
  }

  // the colour of a round, on a light hue scale from blue (first round) to orange (last round seen)
  function roundColour(r, lo, hi) {
    const t = hi > lo ? (r - lo) / (hi - lo) : 0;
    const hue = 225 - 205 * t;
    const light = 80 - 6 * Math.sin(Math.PI * t);
    return "hsl(" + hue.toFixed(1) + " 72% " + light.toFixed(1) + "%)";
  }

  // a token piece with its whitespace made visible
  function pieceNode(piece) {
    const span = el("span", "piece");
    if (piece === "") {
      // no text of its own: a special token (end of text, padding) or the first bytes of a character
      span.textContent = "\u2205";
      return span;
    }
    let plain = "";
    const flush = () => { if (plain) { span.appendChild(document.createTextNode(plain)); plain = ""; } };
    for (const ch of piece) {
      const shown = ch === " " ? "\u00b7" : ch === "\n" ? "\u21b5" : ch === "\t" ? "\u21e5" : null;
      if (shown === null) { plain += ch; continue; }
      flush();
      span.appendChild(el("span", "ws", shown));
    }
    flush();
    return span;
  }

  // ---- the canvas -------------------------------------------------------------------------------
  const canvas = {
    length: 0, blockLen: 0, cells: [], rounds: new Map(), pieces: new Map(), ids: new Map(),
    block: null, fresh: [], lo: Infinity, hi: -Infinity, perRound: [], frame: 0, needRecolour: false,

    reset() {
      this.length = 0; this.blockLen = 0; this.cells = []; this.rounds = new Map(); this.pieces = new Map();
      this.ids = new Map(); this.block = null; this.fresh = []; this.lo = Infinity; this.hi = -Infinity;
      this.perRound = [];
      if (this.frame) cancelAnimationFrame(this.frame);
      this.frame = 0;
      this.needRecolour = false;
      const grid = $("canvas");
      grid.replaceChildren(el("p", "placeholder", "Waiting for the first round..."));
      $("per-round").replaceChildren();
      for (const id of ["info-round", "info-threshold", "info-instance", "info-block", "info-committed"]) {
        $(id).textContent = "-";
      }
      $("legend-min").textContent = "1";
      $("legend-max").textContent = "1";
    },

    build(length, blockLen) {
      this.length = length;
      this.blockLen = blockLen;
      const grid = $("canvas");
      const cells = [];
      const frag = document.createDocumentFragment();
      for (let pos = 0; pos < length; pos++) {
        const cell = el("div", "cell");
        cell.dataset.pos = String(pos);
        cell.setAttribute("role", "img");
        cell.setAttribute("aria-label", "position " + pos + ": not reached");
        cell.appendChild(el("span", "pos", pos));
        cells.push(cell);
        frag.appendChild(cell);
      }
      grid.replaceChildren(frag);
      this.cells = cells;
      this.layout();
    },

    layout() {
      if (!this.length) return;
      const grid = $("canvas");
      const width = grid.clientWidth || 800;
      const maxCols = Math.max(4, Math.min(16, Math.floor(width / 46)));
      const b = Math.max(1, this.blockLen);
      let cols = maxCols;
      if (b <= maxCols) {
        cols = b >= 6 ? b : b * Math.floor(maxCols / b);
      } else {
        for (let c = maxCols; c >= 4; c--) if (b % c === 0) { cols = c; break; }
      }
      grid.style.setProperty("--cols", String(Math.min(cols, this.length)));
    },

    apply(cv) {
      const length = Number(cv.length) || 0;
      const block = Array.isArray(cv.block) ? cv.block : [0, 0];
      if (!this.cells.length || length !== this.length) {
        const keep = this.cells.length ? [...this.rounds.keys()] : [];
        this.build(length, Math.max(1, block[1] - block[0]));
        for (const pos of keep) if (pos < length) this.paint(pos, false);
      }
      const round = Number.isFinite(Number(cv.round)) ? Number(cv.round) : this.perRound.length + 1;
      this.lo = Math.min(this.lo, round);
      const rescale = round > this.hi;
      this.hi = Math.max(this.hi, round);

      for (const pos of this.fresh) this.cells[pos] && this.cells[pos].classList.remove("fresh");
      this.fresh = [];
      if (this.block) {
        for (let p = this.block[0]; p < this.block[1] && p < this.length; p++) this.cells[p].classList.remove("in-block");
      }
      this.block = block;
      for (let p = block[0]; p < block[1] && p < this.length; p++) this.cells[p].classList.add("in-block");
      for (const p of cv.masked || []) {
        if (!this.cells[p]) continue;
        if (this.rounds.has(p)) this.unpaint(p); // masked again (a remasking sampler): no longer committed
        this.cells[p].setAttribute("aria-label", "position " + p + ": masked");
      }

      const committed = cv.committed || [];
      for (const [pos, id, piece] of committed) {
        if (!(pos >= 0 && pos < this.length)) continue;
        this.rounds.set(pos, round);
        this.pieces.set(pos, typeof piece === "string" ? piece : "");
        this.ids.set(pos, id);
        this.paint(pos, true);
        this.fresh.push(pos);
      }
      this.perRound.push({ round: round, n: committed.length, threshold: cv.threshold });
      this.schedule(rescale);

      $("info-round").textContent = String(round);
      $("info-threshold").textContent = typeof cv.threshold === "number" ? cv.threshold.toFixed(2) : "-";
      $("info-instance").textContent = (cv.instance ?? "?") + " \u00b7 TP-" + (cv.tp ?? "?");
      $("info-block").textContent = block[0] + "\u2013" + (block[1] - 1);
      $("info-committed").textContent = this.rounds.size + " / " + this.length;
      $("legend-min").textContent = String(this.lo);
      $("legend-max").textContent = String(this.hi);
    },

    paint(pos, fresh) {
      const cell = this.cells[pos];
      const round = this.rounds.get(pos);
      const piece = this.pieces.get(pos) || "";
      cell.replaceChildren(el("span", "pos", pos), pieceNode(piece), el("span", "r", round));
      cell.classList.add("committed");
      cell.classList.toggle("partial", piece === "" || piece.includes("\ufffd"));
      if (fresh) cell.classList.add("fresh");
      cell.style.backgroundColor = roundColour(round, this.lo, this.hi);
      const label = "position " + pos + ": " + JSON.stringify(piece) + " (token " + this.ids.get(pos) +
        ", round " + round + ")";
      cell.title = label;
      cell.setAttribute("aria-label", label);
    },

    unpaint(pos) {
      const cell = this.cells[pos];
      this.rounds.delete(pos);
      this.pieces.delete(pos);
      this.ids.delete(pos);
      cell.replaceChildren(el("span", "pos", pos));
      cell.classList.remove("committed", "partial", "fresh");
      cell.style.backgroundColor = "";
      cell.removeAttribute("title");
    },

    // the colour scale and the per-round bars change with every round: redrawn at most once a frame
    schedule(rescale) {
      this.needRecolour = this.needRecolour || rescale;
      if (this.frame) return;
      this.frame = requestAnimationFrame(() => this.repaint());
    },

    repaint() {
      if (this.frame) cancelAnimationFrame(this.frame);
      this.frame = 0;
      if (this.needRecolour) this.recolour();
      this.needRecolour = false;
      this.drawPerRound();
    },

    finish() { // the stream ended: no current block, no round in progress
      for (const cell of this.cells) cell.classList.remove("fresh", "in-block");
      this.fresh = [];
      this.block = null;
      this.repaint();
    },

    recolour() {
      for (const [pos, round] of this.rounds) this.cells[pos].style.backgroundColor = roundColour(round, this.lo, this.hi);
    },

    drawPerRound() {
      const box = $("per-round");
      const max = Math.max(1, ...this.perRound.map((x) => x.n));
      const bars = this.perRound.map((x) => {
        const bar = el("span", "bar");
        bar.style.height = Math.max(4, (100 * x.n) / max) + "%";
        bar.style.backgroundColor = roundColour(x.round, this.lo, this.hi);
        const t = typeof x.threshold === "number" ? " at threshold " + x.threshold.toFixed(2) : "";
        bar.title = "round " + x.round + ": " + x.n + " position" + (x.n === 1 ? "" : "s") + t;
        return bar;
      });
      box.classList.toggle("dense", bars.length > 120);
      box.replaceChildren(...bars);
    },
  };

  // ---- the request -------------------------------------------------------------------------------
  let controller = null;

  function setStatus(state, text, rounds) {
    const s = $("status");
    s.dataset.state = state;
    s.textContent = text;
    if (rounds !== undefined) s.dataset.rounds = String(rounds);
  }

  function numberField(id, parse, name, body, check) {
    const raw = $(id).value.trim();
    if (raw === "") return;
    const v = parse(raw);
    if (!Number.isFinite(v) || (check && !check(v))) throw new Error("invalid " + name + ": " + raw);
    body[name] = v;
  }

  function requestBody() {
    const prompt = $("prompt").value;
    if (!prompt.trim()) throw new Error("the prompt is empty");
    const body = {
      messages: [{ role: "user", content: prompt }],
      stream: true,
      stream_options: { include_canvas: true },
    };
    const model = $("model").value;
    if (model) body.model = model;
    numberField("threshold", Number, "threshold", body, (v) => v > 0 && v <= 1);
    numberField("slo", Number, "slo_ms", body, (v) => v >= 0);
    numberField("temperature", Number, "temperature", body, (v) => v >= 0);
    numberField("max-tokens", Number, "max_tokens", body, (v) => Number.isInteger(v) && v >= 1);
    numberField("seed", Number, "seed", body, Number.isInteger);
    return body;
  }

  // server-sent events from a fetch response: calls onData(data) for each event's data
  async function readEvents(resp, onData) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    let held = ""; // a trailing "\r" that may be half of a "\r\n" split across reads
    const dispatch = (block) => {
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      }
      if (data.length) onData(data.join("\n"));
    };
    for (;;) {
      const { value, done } = await reader.read();
      let text = held + (done ? decoder.decode() : decoder.decode(value, { stream: true }));
      held = "";
      if (!done && text.endsWith("\r")) { held = "\r"; text = text.slice(0, -1); }
      buf += text.replace(/\r\n?/g, "\n");
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        dispatch(buf.slice(0, i));
        buf = buf.slice(i + 2);
      }
      if (done) break;
    }
    if (buf.trim()) dispatch(buf);
  }

  async function send(event) {
    event.preventDefault();
    if (controller) return;
    $("form-error").textContent = "";
    let body;
    try {
      body = requestBody();
    } catch (err) {
      $("form-error").textContent = err.message;
      return;
    }
    controller = new AbortController();
    $("send").disabled = true;
    $("stop").disabled = false;
    canvas.reset();
    let answer = "";
    let rounds = 0;
    let finish = null;
    let usage = null;
    let sawDone = false;
    $("answer").textContent = "";
    $("summary").textContent = "";
    setStatus("running", "sending...", 0);
    const t0 = performance.now();
    try {
      const resp = await fetch("v1/chat/completions", {
        method: "POST", headers: authHeaders(true), body: JSON.stringify(body), signal: controller.signal,
        cache: "no-store",
      });
      if (!resp.ok) throw new Error(await errorText(resp));
      setStatus("running", "streaming...", 0);
      await readEvents(resp, (data) => {
        if (data === "[DONE]") { sawDone = true; return; }
        let chunk;
        try { chunk = JSON.parse(data); } catch (_) { throw new Error("unreadable chunk: " + data.slice(0, 80)); }
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        const cv = chunk.remask_canvas;
        if (cv && (cv.index ?? 0) === 0) {
          rounds += 1;
          canvas.apply(cv);
          $("status").dataset.rounds = String(rounds);
          $("status").textContent = "streaming... round " + cv.round;
        }
        for (const choice of chunk.choices || []) {
          if ((choice.index ?? 0) !== 0) continue;
          const piece = choice.delta ? choice.delta.content : choice.text;
          if (typeof piece === "string" && piece) {
            answer += piece;
            $("answer").textContent = answer;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        if (chunk.usage) usage = chunk.usage;
      });
      if (!sawDone) throw new Error("the stream ended before [DONE]");
      const secs = (performance.now() - t0) / 1000;
      const n = canvas.rounds.size;
      const parts = [n + " positions committed in " + rounds + " rounds"];
      if (rounds) parts.push((n / rounds).toFixed(2) + " per round");
      parts.push(secs.toFixed(2) + " s");
      if (finish) parts.push("finish: " + finish);
      if (usage) parts.push(usage.completion_tokens + " completion tokens");
      $("summary").textContent = parts.join(" \u00b7 ");
      canvas.finish();
      setStatus("done", "done", rounds);
    } catch (err) {
      const msg = err && err.name === "AbortError" ? "stopped" : (err && err.message) || String(err);
      if (controller) controller.abort(); // a failed stream: close the connection (frees the request)
      if (!canvas.cells.length) {
        $("canvas").replaceChildren(el("p", "placeholder", "No canvas: the request ended before its first round."));
      }
      setStatus("error", "error: " + msg, rounds);
    } finally {
      controller = null;
      $("send").disabled = false;
      $("stop").disabled = true;
    }
  }

  // ---- models -------------------------------------------------------------------------------------
  async function loadModels() {
    const select = $("model");
    const keep = select.value;
    try {
      const resp = await fetch("v1/models", { headers: authHeaders(false), cache: "no-store" });
      if (!resp.ok) throw new Error(await errorText(resp));
      const ids = ((await resp.json()).data || []).map((m) => m.id).filter(Boolean);
      if (!ids.length) return;
      select.replaceChildren(...ids.map((id) => { const o = el("option", null, id); o.value = id; return o; }));
      if (ids.includes(keep)) select.value = keep;
    } catch (err) {
      select.replaceChildren(el("option", null, "(server default)"));
      select.firstChild.value = "";
      select.title = "could not list models: " + err.message;
    }
  }

  // ---- the cluster panel ----------------------------------------------------------------------------
  function fmtPct(x) { return x === null || x === undefined ? "-" : Math.round(x * 100) + "%"; }

  function renderCluster(view) {
    const slo = view.slo || {};
    const kSlo = $("kpi-slo");
    kSlo.textContent = fmtPct(slo.attainment);
    kSlo.className = "kpi-value" + (slo.attainment == null ? "" : slo.attainment >= 0.9 ? " good" : " bad");
    kSlo.title = slo.finished ? slo.met + " of " + slo.finished + " requests met their SLO" : "no request finished";
    $("kpi-live").textContent = String(view.live ?? "-");
    $("kpi-instances").textContent = String((view.instances || []).length);

    const tps = Object.values(view.by_tp || {});
    $("tp-rows").replaceChildren(...(tps.length ? tps.map((t) => {
      const tr = el("tr");
      for (const v of ["TP-" + t.tp, t.instances, t.requests, t.running, t.waiting]) tr.appendChild(el("td", null, v));
      return tr;
    }) : [(() => { const tr = el("tr"); const td = el("td", "muted", "no instance has joined"); td.colSpan = 5;
      tr.appendChild(td); return tr; })()]));

    $("instance-list").replaceChildren(...(view.instances || []).map((i) => {
      const li = el("li");
      const row = el("div", "row");
      const name = el("span", "name", "#" + i.id + " \u00b7 TP-" + i.tp);
      if (i.draining) { name.appendChild(document.createTextNode(" ")); name.appendChild(el("span", "tag", "draining")); }
      row.appendChild(name);
      const filled = i.slots ? i.running + " / " + i.slots + " slots" : i.running + " running";
      const extra = [filled, i.waiting + " waiting"];
      if (i.slots_per_round != null) extra.push(i.slots_per_round + " per round");
      row.appendChild(el("span", "muted", extra.join(" \u00b7 ")));
      li.appendChild(row);
      const meter = el("div", "meter");
      const fill = el("span");
      const cap = i.slots || Math.max(i.running + i.waiting, 1);
      fill.style.width = Math.min(100, (100 * i.running) / cap) + "%";
      meter.appendChild(fill);
      meter.setAttribute("role", "meter");
      meter.setAttribute("aria-label", "instance " + i.id + " slots filled");
      meter.setAttribute("aria-valuemin", "0");
      meter.setAttribute("aria-valuemax", String(cap));
      meter.setAttribute("aria-valuenow", String(i.running));
      li.appendChild(meter);
      return li;
    }));

    const used = Object.entries((view.thresholds || {}).in_use || {});
    $("thresholds").replaceChildren(...(used.length
      ? used.map(([t, n]) => el("span", "chip", t + " \u00d7" + n))
      : [el("span", "muted", "no live request")]));

    const plan = view.planner || {};
    const box = $("planner");
    if (!plan.enabled) {
      box.replaceChildren(el("span", "muted", "off (fixed replica counts)"));
    } else {
      const counts = (o) => Object.entries(o || {}).map(([d, n]) => "TP-" + d + " \u00d7" + n).join(", ") || "none";
      const lines = [el("div", null, "targets " + counts(plan.targets) + " \u00b7 live " + counts(plan.live))];
      const dec = plan.last_decision;
      lines.push(el("div", "decision", dec
        ? "last decision: " + (dec.act ? "act" : "hold") + " \u2014 " + dec.reason
        : "last decision: none yet"));
      box.replaceChildren(...lines);
    }
  }

  // one polling loop; restartCluster() (a new API key) starts a fresh one and drops the old one's answers
  let clusterGen = 0;
  let clusterTimer = null;

  async function pollCluster(gen) {
    let wait = CLUSTER_EVERY_MS;
    let view = null;
    let failure = null;
    try {
      const resp = await fetch("debug/cluster", { headers: authHeaders(false), cache: "no-store" });
      if (!resp.ok) throw new Error(await errorText(resp));
      view = await resp.json();
    } catch (err) {
      failure = err;
      wait = 5 * CLUSTER_EVERY_MS;
    }
    if (gen !== clusterGen) return; // superseded
    if (view) {
      try {
        renderCluster(view);
        $("cluster-updated").textContent = "updated " + new Date().toLocaleTimeString();
      } catch (err) {
        $("cluster-updated").textContent = "unreadable: " + err.message;
      }
    } else {
      $("cluster-updated").textContent = "unavailable: " + failure.message;
    }
    clusterTimer = setTimeout(() => pollCluster(gen), wait);
  }

  function restartCluster() {
    clusterGen += 1;
    clearTimeout(clusterTimer);
    pollCluster(clusterGen);
  }

  // ---- wiring -------------------------------------------------------------------------------------------
  function init() {
    const keyInput = $("api-key");
    try { keyInput.value = localStorage.getItem(KEY_STORE) || ""; } catch (_) { /* storage disabled */ }
    keyInput.addEventListener("change", () => {
      try {
        if (keyInput.value.trim()) localStorage.setItem(KEY_STORE, keyInput.value.trim());
        else localStorage.removeItem(KEY_STORE);
      } catch (_) { /* storage disabled */ }
      loadModels();
      restartCluster();
    });
    $("form").addEventListener("submit", send);
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("form").requestSubmit();
    });
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => canvas.layout(), 100);
    });
    loadModels();
    restartCluster();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
