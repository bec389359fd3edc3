// Headroom budget page: read the form, POST /api/v1/estimate on every change, draw the answer.
// Plain browser JavaScript, no dependencies. The server does all the arithmetic; this file only
// formats bytes and lays out bars.
"use strict";

(() => {
  const API = "/api/v1";
  const GIB = 2 ** 30;
  const DEBOUNCE_MS = 120;
  const CUSTOM = "__custom__";
  const DEFAULT_MODELS = ["llama-3-8b"];
  const DEFAULT_GPUS = ["H200-141GB", "H100-80GB"];
  const GPU_BUCKETS = [
    "params", "grads", "master_params", "optimizer_states", "ema", "activations", "logits",
    "moe_dispatch", "transfer_buffers", "cuda_context", "allocator_overhead",
  ];
  const PHASES = ["step1_forward", "step1_backward", "forward", "backward", "optimizer"];
  const PHASE_HINTS = {
    step1_forward: "the first step's forward: no optimizer state allocated yet",
    step1_backward: "the first step's backward: no optimizer state allocated yet",
    forward: "a later step's forward, beside the optimizer state",
    backward: "a later step's backward, beside the optimizer state",
    optimizer: "the optimizer step",
  };

  const $ = (id) => document.getElementById(id);
  const el = (tag, props = {}, children = []) => {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props)) {
      if (key === "dataset") Object.assign(node.dataset, value);
      else if (key === "class") node.className = value;
      else node[key] = value;
    }
    node.append(...children);
    return node;
  };

  /** A problem with the form itself, found before asking the server. */
  class InputError extends Error {}

  const fmtGiB = (bytes) =>
    (bytes / GIB).toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
  // the summary cards: no decimals from 1000 GiB on, so that the number stays on one line
  const fmtCardGiB = (bytes) =>
    Math.abs(bytes) >= 1000 * GIB
      ? (bytes / GIB).toLocaleString("en-US", { maximumFractionDigits: 0 })
      : fmtGiB(bytes);
  const fmtBytes = (bytes) => `${bytes.toLocaleString("en-US")} bytes`;
  const fmtPct = (part, whole) => (whole ? `${((100 * part) / whole).toFixed(1)}%` : "–");
  const fmtParams = (n) => (n >= 1e9 ? `${(n / 1e9).toFixed(1)}B` : `${(n / 1e6).toFixed(1)}M`);

  let timer = null;
  let inflight = null;
  let sequence = 0;
  /** The request (JSON) the fit table answers; null when it shows nothing. */
  let fitFor = null;
  /** The plan request (JSON) the plan table answers; null before the first plan. */
  let planFor = null;
  /** The last estimate's request and answer: what the share buttons hand out. */
  let lastShare = null;

  // ---- reading the form ------------------------------------------------------------------

  function readNumber(id) {
    const input = $(id);
    const raw = input.value.trim();
    const value = Number(raw);
    if (raw === "" || (input.validity && input.validity.badInput) || !Number.isFinite(value)) {
      throw new InputError(`${id}: enter a number`);
    }
    return value;
  }

  /** The object a JSON textarea holds; ``what`` names it in the error, ``empty`` says what
   *  to paste. */
  function readJsonObject(id, what, empty) {
    const text = $(id).value.trim();
    if (!text) throw new InputError(`${what}: ${empty}`);
    let parsed;
    try {
      parsed = JSON.parse(text);
    } catch (err) {
      throw new InputError(`${what} is not valid JSON: ${err.message}`);
    }
    if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
      throw new InputError(`${what} must be an object`);
    }
    return parsed;
  }

  function readGpu() {
    const choice = $("gpu").value;
    if (choice !== CUSTOM) return choice;
    return readJsonObject("gpu_json", "GPU JSON", "paste a GPU as a GPU file holds it");
  }

  function readModel() {
    const choice = $("model").value;
    if (choice !== CUSTOM) return choice;
    return readJsonObject(
      "model_json", "Model JSON", "paste our model spec or a Hugging Face config.json");
  }

  function buildRequest() {
    const mode = $("offload_mode").value;
    const offload = { mode };
    if (mode === "optimizer") offload.fraction = readNumber("offload_fraction");
    if (mode === "streaming") {
      if ($("checkpoint_every").value.trim()) {
        offload.checkpoint_every = readNumber("checkpoint_every");
      }
      offload.num_buffers = readNumber("num_buffers");
    }
    const recompute = $("recompute").value === "every"
      ? { every_k: readNumber("recompute_every") }
      : $("recompute").value;
    const body = {
      model: readModel(),
      train: {
        micro_batch_size: readNumber("micro_batch_size"),
        seq_len: readNumber("seq_len"),
        grad_accum_steps: readNumber("grad_accum_steps"),
        recompute,
        expandable_segments: $("expandable_segments").checked,
        attention: $("attention").value,
        optimizer: $("optimizer").value,
        ema: $("ema").value,
        offload,
        parallel: {
          dp: readNumber("dp"),
          tp: readNumber("tp"),
          pp: readNumber("pp"),
          vpp: readNumber("vpp"),
          cp: readNumber("cp"),
          ep: readNumber("ep"),
          sequence_parallel: $("sequence_parallel").checked,
          zero_stage: Number($("zero_stage").value),
        },
        framework: $("framework").value,
        activation_profile: $("activation_profile").value,
      },
      gpu: readGpu(),
    };
    const host = $("host_memory").value.trim();
    if (host) body.host_memory = host;
    if ($("gpus_per_node").value.trim()) body.gpus_per_node = readNumber("gpus_per_node");
    return body;
  }

  // ---- talking to the server -------------------------------------------------------------

  /** POST ``body`` to a route as JSON: the response and its JSON (null if it has none). */
  async function postJson(route, body, signal) {
    const response = await fetch(`${API}/${route}`, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "application/json" },
      body: JSON.stringify(body),
      signal,
    });
    const data = await response.json().catch(() => null);
    return { response, data };
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(update, DEBOUNCE_MS);
  }

  async function update() {
    let body;
    try {
      body = buildRequest();
    } catch (err) {
      if (!(err instanceof InputError)) throw err;
      if (inflight) inflight.abort();
      sequence += 1;
      setBusy(false);
      showError("Check the form", err.message);
      return;
    }
    if (inflight) inflight.abort();
    const controller = new AbortController();
    inflight = controller;
    const mine = ++sequence;
    setBusy(true);
    let response;
    let data;
    try {
      ({ response, data } = await postJson("estimate", body, controller.signal));
    } catch (err) {
      if (err.name === "AbortError" || mine !== sequence) return;
      setBusy(false);
      showError("Cannot reach the server", err.message);
      return;
    }
    if (mine !== sequence) return; // a newer request is on its way
    inflight = null;
    setBusy(false);
    if (!response.ok || !data || !data.gpu) {
      const detail = data && data.detail ? data.detail : `HTTP ${response.status} ${response.statusText}`;
      showError((data && data.title) || "Error", detail);
      return;
    }
    clearError();
    render(data);
    updateShare(body, data);
    // a spec that does not fit offers the ladder's answer; one found for another spec goes
    $("fit").hidden = data.fits;
    if (fitFor !== JSON.stringify(body)) {
      fitFor = null;
      $("fit-table").hidden = true;
      $("fit-summary").textContent = "";
      $("fit-error").hidden = true;
      delete $("fit").dataset.state;
    }
  }

  function setBusy(busy) {
    $("status").textContent = busy ? "updating…" : "";
    $("results").setAttribute("aria-busy", busy ? "true" : "false");
  }

  function showError(title, detail) {
    // nothing was estimated: no caption of the model or GPU the last estimate was of
    $("model-params").textContent = "";
    $("gpu-name").textContent = "";
    const box = $("error");
    box.replaceChildren(
      el("strong", { textContent: `${title}: ` }),
      el("span", { id: "error-detail", textContent: detail }),
    );
    box.hidden = false;
    $("results").dataset.state = "error";
  }

  function clearError() {
    const box = $("error");
    box.replaceChildren();
    box.hidden = true;
  }

  // ---- drawing ---------------------------------------------------------------------------

  function render(b) {
    const gpu = b.gpu;
    const verdict = $("verdict");
    verdict.textContent = b.fits ? "fits" : "does not fit";
    verdict.dataset.fits = String(b.fits);

    $("gpu-peak").textContent = `${fmtCardGiB(gpu.peak_bytes)} GiB`;
    $("gpu-peak").title = fmtBytes(gpu.peak_bytes);
    $("gpu-capacity").textContent = `of ${fmtGiB(gpu.capacity_bytes)} GiB`;
    const headroom = gpu.headroom_bytes;
    $("gpu-headroom").textContent = `${headroom < 0 ? "−" : ""}${fmtCardGiB(Math.abs(headroom))} GiB`;
    $("gpu-headroom").title = fmtBytes(headroom);
    $("gpu-headroom").classList.toggle("negative", headroom < 0);
    $("gpu-headroom-pct").textContent =
      headroom < 0
        ? `over capacity by ${fmtPct(-headroom, gpu.capacity_bytes)}`
        : `${fmtPct(headroom, gpu.capacity_bytes)} of capacity free`;
    $("peak-phase").textContent = b.peak_phase;
    const c = b.coefficients || {};
    const margin = b.margin_bytes ? `, margin ${fmtGiB(b.margin_bytes)} GiB` : "";
    $("coefficients").textContent =
      `${c.profile || "?"} coefficients, ${c.calibrated ? "calibrated" : "uncalibrated"}${margin}`;
    $("gpu-name").textContent = `· ${gpu.name}`;
    showTrust(gpu.name, $("framework").value, c);
    $("model-params").textContent = `${b.model.name}: ${fmtParams(b.model.params_total)} parameters`;

    const warnings = $("warnings");
    warnings.replaceChildren(...(b.warnings || []).map((w) => el("li", { textContent: w })));
    warnings.hidden = !(b.warnings && b.warnings.length);

    drawBar($("gpu-bar"), $("gpu-legend"), $("gpu-scale-max"), GPU_BUCKETS, gpu.buckets,
      gpu.peak_bytes, gpu.capacity_bytes, "GPU");

    const host = b.host;
    drawBar($("host-bar"), $("host-legend"), $("host-scale-max"), Object.keys(host.buckets),
      host.buckets, host.peak_bytes, host.capacity_bytes, "Host");
    const shared = host.ranks_sharing > 1 ? `, ${host.ranks_sharing} ranks share the node` : "";
    $("host-summary").textContent =
      host.capacity_bytes === null
        ? `· peak ${fmtGiB(host.peak_bytes)} GiB, capacity unknown${shared}`
        : `· peak ${fmtGiB(host.peak_bytes)} GiB of ${fmtGiB(host.capacity_bytes)} GiB${shared}`;

    drawPhases(gpu, b.peak_phase);
    $("results").dataset.state = "ok";
  }

  // ---- trust: what the stack's measured runs say (GET /coefficients' trust per stack) -----

  let trustTable = null; // "gpu|framework|profile" -> the stack's trust entry
  let trustFetched = 0;

  async function loadTrust() {
    if (trustTable !== null && Date.now() - trustFetched < 30000) return trustTable;
    const table = {};
    try {
      const response = await fetch(`${API}/coefficients`, { headers: { Accept: "application/json" } });
      if (response.ok) {
        for (const set of await response.json()) {
          for (const t of set.trust || []) table[`${t.gpu}|${t.framework}|${t.activation_profile}`] = t;
        }
      }
    } catch (err) {
      // no trust to show is no error: the verdict stands on the default margin
    }
    trustTable = table;
    trustFetched = Date.now();
    return table;
  }

  function pctSigned(x) {
    return `${x < 0 ? "−" : "+"}${Math.abs(100 * x).toFixed(1)} %`;
  }

  async function showTrust(gpuName, framework, c) {
    const box = $("trust");
    const profile = c.profile || "?";
    const stack = `${framework}/${profile} on ${gpuName}`;
    const t = (await loadTrust())[`${gpuName}|${framework}|${profile}`];
    if (t && t.margin_fraction !== null && t.recent_records > 0) {
      const worst = t.observed_error ? `, worst ${pctSigned(t.observed_error)}` : "";
      box.textContent =
        `calibrated on ${t.recent_records} run${t.recent_records === 1 ? "" : "s"} of ${stack}` +
        `${worst}: ${t.trusted ? "trusted" : "untrusted"}, margin ` +
        `${Math.round(100 * t.margin_fraction)} % with calibration`;
      box.dataset.trusted = String(t.trusted);
    } else {
      const margin = typeof c.margin_fraction === "number" ? Math.round(100 * c.margin_fraction) : "?";
      box.textContent = `no measured runs of ${stack}: the default margin, ${margin} %`;
      box.dataset.trusted = "none";
    }
  }

  function drawBar(bar, legend, scaleLabel, names, buckets, peak, capacity, what) {
    const track = bar.querySelector(".track");
    const scale = Math.max(peak, capacity || 0) || 1;
    const segments = [];
    for (const name of names) {
      const bytes = buckets[name] || 0;
      if (bytes <= 0) continue;
      const share = (100 * bytes) / scale;
      const segment = el("div", {
        class: `segment b-${name}`,
        title: `${name}: ${fmtGiB(bytes)} GiB (${fmtPct(bytes, peak)} of peak)`,
        dataset: { bucket: name, bytes: String(bytes) },
      }, share >= 8 ? [el("span", { textContent: name })] : []);
      segment.style.width = `${share}%`;
      segments.push(segment);
    }
    if (capacity) {
      const line = el("div", { class: "capacity-line", title: `capacity ${fmtGiB(capacity)} GiB` },
        [el("span", { textContent: `capacity ${fmtGiB(capacity)} GiB` })]);
      const at = (100 * capacity) / scale;
      line.style.left = `${at}%`;
      line.classList.toggle("label-after", at < 30); // keep the label inside the panel
      segments.push(line);
    }
    if (!peak) segments.push(el("div", { class: "empty", textContent: "nothing kept here" }));
    track.replaceChildren(...segments);
    bar.dataset.peakBytes = String(peak);
    bar.dataset.capacityBytes = capacity === null || capacity === undefined ? "" : String(capacity);
    bar.classList.toggle("over", Boolean(capacity) && peak > capacity);
    bar.setAttribute("aria-label", `${what} peak ${fmtGiB(peak)} GiB` +
      (capacity ? ` of ${fmtGiB(capacity)} GiB capacity` : ", capacity unknown"));
    scaleLabel.textContent = `${fmtGiB(scale)} GiB`;

    legend.replaceChildren(...names.map((name) => {
      const bytes = buckets[name] || 0;
      return el("li", { class: `b-${name}${bytes ? "" : " zero"}`, dataset: { bucket: name } }, [
        el("span", { class: "swatch", ariaHidden: "true" }),
        el("span", { class: "name", textContent: name }),
        el("span", { class: "value", textContent: `${fmtGiB(bytes)} GiB` }),
        el("span", { class: "pct", textContent: fmtPct(bytes, peak) }),
      ]);
    }));
  }

  function drawPhases(gpu, peakPhase) {
    const capacity = gpu.capacity_bytes;
    const totals = PHASES.filter((p) => gpu.phases[p]).map((p) => gpu.phases[p].total_bytes);
    const scale = Math.max(capacity, ...totals) || 1;
    const rows = PHASES.filter((p) => gpu.phases[p]).map((phase) => {
      const total = gpu.phases[phase].total_bytes;
      const fill = el("div", { class: `fill${total > capacity ? " over" : ""}` });
      fill.style.width = `${(100 * total) / scale}%`;
      const mark = el("div", { class: "mark" });
      mark.style.left = `${(100 * capacity) / scale}%`;
      const isPeak = phase === peakPhase;
      return el("tr", {
        id: `phase-${phase}`,
        class: isPeak ? "peak" : "",
        title: PHASE_HINTS[phase] || "",
        dataset: { phase, totalBytes: String(total) },
      }, [
        el("th", { scope: "row" }, [phase,
          ...(isPeak ? [el("span", { class: "badge", textContent: "peak" })] : []),
          el("span", { class: "hint phase-hint", textContent: PHASE_HINTS[phase] || "" })]),
        el("td", { class: "num", textContent: fmtGiB(total) }),
        el("td", { class: "num", textContent: fmtPct(total, capacity) }),
        el("td", { class: "load" }, [el("div", { class: "minibar" }, [fill, mark])]),
      ]);
    });
    $("phases").tBodies[0].replaceChildren(...rows);
  }

  // ---- the cluster plan ------------------------------------------------------------------

  /** The plan's cluster: none (the GPU's node preset), a preset's name or a pasted one. */
  function readCluster() {
    const choice = $("plan_cluster").value;
    if (!choice) return {};
    if (choice !== CUSTOM) return { cluster: choice };
    return {
      cluster: readJsonObject("cluster_json", "Cluster JSON", "paste a cluster as a cluster file holds it"),
    };
  }

  function buildPlanRequest() {
    const estimate = buildRequest();
    const t = estimate.train;
    return {
      model: estimate.model,
      // the plan chooses the layout, batch shape, recompute and offload; the rest is the form's
      train: {
        attention: t.attention,
        optimizer: t.optimizer,
        ema: t.ema,
        framework: t.framework,
        activation_profile: t.activation_profile,
      },
      gpu: estimate.gpu,
      ...readCluster(),
      gpus: readNumber("plan_gpus"),
      gpus_per_node: readNumber("plan_gpus_per_node"),
      global_batch: readNumber("plan_global_batch"),
      seq_len: t.seq_len,
    };
  }

  function layoutText(parallel) {
    const p = parallel;
    let text = `TP ${p.tp} · PP ${p.pp}${p.vpp > 1 ? `×${p.vpp}` : ""} · CP ${p.cp} · DP ${p.dp}`;
    if (p.ep > 1) text += ` · EP ${p.ep}`;
    return `${text} · ZeRO ${p.zero_stage}`;
  }

  function perRankText(c) {
    const recompute = typeof c.recompute === "string" ? c.recompute : `every ${c.recompute.every_k}`;
    const offload = c.offload.mode === "optimizer"
      ? `optimizer ${c.offload.fraction}` : c.offload.mode;
    return `micro ${c.micro_batch_size} × ${c.grad_accum_steps}, recompute ${recompute}, ` +
      `offload ${offload}`;
  }

  function planRow(c, capacity, chosen, buckets) {
    const apply = el("button", { type: "button", class: "apply", textContent: "Apply" });
    apply.addEventListener("click", () => applyPlan(c));
    const bar = el("div", {
      class: "bar mini",
      role: "img",
      dataset: { peakBytes: String(c.gpu_peak_bytes), capacityBytes: String(capacity) },
    }, [el("div", { class: "track" })]);
    const track = bar.querySelector(".track");
    const scale = Math.max(c.gpu_peak_bytes, capacity) || 1;
    const parts = buckets
      ? GPU_BUCKETS.filter((n) => buckets[n] > 0).map((n) => [n, buckets[n]])
      : [["total", c.gpu_peak_bytes]];
    for (const [name, bytes] of parts) {
      const segment = el("div", {
        class: `segment b-${name}`,
        title: `${name}: ${fmtGiB(bytes)} GiB`,
        dataset: { bucket: name, bytes: String(bytes) },
      });
      segment.style.width = `${(100 * bytes) / scale}%`;
      track.append(segment);
    }
    const line = el("div", { class: "capacity-line" });
    line.style.left = `${(100 * capacity) / scale}%`;
    track.append(line);
    bar.setAttribute("aria-label", `GPU peak ${fmtGiB(c.gpu_peak_bytes)} GiB of ${fmtGiB(capacity)} GiB`);
    return el("tr", {
      class: `plan-row${chosen ? " chosen" : ""}`,
      dataset: { stepSeconds: String(c.step_seconds), peakBytes: String(c.gpu_peak_bytes) },
    }, [
      el("th", { scope: "row" }, [layoutText(c.parallel),
        ...(chosen ? [el("span", { class: "badge", textContent: "chosen" })] : [])]),
      el("td", { class: "num", textContent: String(c.gpus_used) }),
      el("td", { textContent: perRankText(c) }),
      el("td", { class: "num", textContent: c.step_seconds.toFixed(3) }),
      el("td", { class: "load" }, [bar, el("span", { class: "hint",
        textContent: ` ${fmtGiB(c.gpu_peak_bytes)} GiB` })]),
      el("td", {}, [apply]),
    ]);
  }

  function renderPlan(r) {
    const table = $("plan-table");
    const rows = [];
    if (r.fits) {
      const p = r.plan;
      const capacity = r.budget.gpu.capacity_bytes;
      const chosen = {
        parallel: p.parallel,
        gpus_used: r.gpus_used,
        micro_batch_size: p.micro_batch_size,
        grad_accum_steps: p.grad_accum_steps,
        recompute: p.recompute,
        offload: p.offload,
        step_seconds: r.predicted_step_seconds,
        gpu_peak_bytes: r.budget.gpu.peak_bytes,
      };
      rows.push(planRow(chosen, capacity, true, r.budget.gpu.buckets));
      for (const c of r.runners_up) rows.push(planRow(c, capacity, false, null));
    }
    table.tBodies[0].replaceChildren(...rows);
    table.hidden = !r.fits;
    const rejected = Object.entries(r.rejected_by_reason)
      .filter(([, n]) => n > 0).map(([k, n]) => `${k} ${n.toLocaleString("en-US")}`).join(", ");
    $("plan-summary").textContent = (r.fits
      ? `${layoutText(r.plan.parallel)} on ${r.gpus_used} of ${r.gpus} GPUs (${r.cluster}): ` +
        `${r.predicted_step_seconds.toFixed(3)} s per step. `
      : "Nothing fits. ") +
      `${r.candidates_considered.toLocaleString("en-US")} candidates over ` +
      `${r.layouts_considered.toLocaleString("en-US")} layouts; rejected: ${rejected || "none"}.`;
    $("plan").dataset.fits = String(r.fits);
  }

  /** A panel's request (``name``: its element ids' prefix): built by ``build`` (a form
   *  mistake is shown in the panel's error box), posted to ``route``; ``started`` hears the
   *  body once it is sent. The body and the answer, or null once the panel shows why none. */
  async function panelRequest(name, build, route, busy, started) {
    const box = $(`${name}-error`);
    box.hidden = true;
    let body;
    try {
      body = build();
    } catch (err) {
      if (!(err instanceof InputError)) throw err;
      box.textContent = err.message;
      box.hidden = false;
      return null;
    }
    $(name).dataset.state = "loading";
    $(`${name}-summary`).textContent = busy;
    started(body);
    let response;
    let data;
    try {
      ({ response, data } = await postJson(route, body));
    } catch (err) {
      box.textContent = `Cannot reach the server: ${err.message}`;
      box.hidden = false;
      $(name).dataset.state = "error";
      return null;
    }
    return { body, response, data };
  }

  /** The panel's request was refused: the server's reason, and no table. */
  function panelRefused(name, response, data) {
    const box = $(`${name}-error`);
    box.textContent = (data && data.detail) || `HTTP ${response.status} ${response.statusText}`;
    box.hidden = false;
    $(`${name}-summary`).textContent = "";
    $(`${name}-table`).hidden = true;
    $(name).dataset.state = "error";
  }

  async function runPlan() {
    const answer = await panelRequest("plan", buildPlanRequest, "plan", "planning…", () => {});
    if (answer === null) return;
    const { body, response, data } = answer;
    if (!response.ok || !data || data.fits === undefined) {
      panelRefused("plan", response, data);
      planFor = null; // no table left to be stale
      markPlanStale();
      return;
    }
    renderPlan(data);
    planFor = JSON.stringify(body);
    markPlanStale();
    $("plan").dataset.state = "ok";
  }

  // ---- take it with you: the command, the files, the link --------------------------------

  /** A shell word, quoted only when it needs it. */
  function shellWord(word) {
    return /^[A-Za-z0-9_.,:=\/+@%-]+$/.test(word) ? word : `'${word.replace(/'/g, "'\\''")}'`;
  }

  /** ``--set key=value`` for every leaf of ``value`` under ``prefix``. */
  function setArgs(prefix, value) {
    if (value !== null && typeof value === "object") {
      return Object.entries(value).flatMap(([k, v]) => setArgs(prefix ? `${prefix}.${k}` : k, v));
    }
    return ["--set", `${prefix}=${value}`];
  }

  /** The CLI command that estimates what the form holds (a pasted model or GPU: the file the
   *  page downloads beside it). */
  function cliCommand(body) {
    const words = ["headroom", "estimate", typeof body.model === "string" ? body.model : "model.json",
      "--gpu", typeof body.gpu === "string" ? body.gpu : "gpu.json", ...setArgs("", body.train)];
    if (body.host_memory) words.push("--host-memory", body.host_memory);
    if (body.gpus_per_node) words.push("--gpus-per-node", String(body.gpus_per_node));
    return words.map(shellWord).join(" ");
  }

  /** Offer ``text`` as a download named ``name``. */
  function download(name, text) {
    const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
    const link = el("a", { href: url, download: name });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  async function copy(text, what) {
    try {
      await navigator.clipboard.writeText(text);
      $("share-status").textContent = `${what} copied`;
    } catch (err) {
      $("share-status").textContent = `${what} could not be copied here: select it instead`;
    }
  }

  /** Every control's value in both forms, by id: what the page's link holds. */
  function formState() {
    const state = {};
    for (const form of [$("controls"), $("plan-form")]) {
      for (const field of form.querySelectorAll("input, select, textarea")) {
        state[field.id] = field.type === "checkbox" ? field.checked : field.value;
      }
    }
    return state;
  }

  /** The form as a link's state held it (unknown ids and values a select lacks are left). */
  function restoreState(state) {
    for (const [id, value] of Object.entries(state)) {
      const field = document.getElementById(id);
      if (!field || !field.closest("#controls, #plan-form")) continue;
      if (field.type === "checkbox") field.checked = Boolean(value);
      else if (field.tagName !== "SELECT" || [...field.options].some((o) => o.value === value)) {
        field.value = String(value);
      }
    }
  }

  function readHashState() {
    const hash = window.location.hash.replace(/^#/, "");
    if (!hash.startsWith("s=")) return null;
    try {
      const state = JSON.parse(decodeURIComponent(hash.slice(2)));
      return state && typeof state === "object" && !Array.isArray(state) ? state : null;
    } catch (err) {
      return null;
    }
  }

  /** After each estimate: the command, and the link that reopens this form. */
  function updateShare(body, budget) {
    $("cli-command").textContent = cliCommand(body);
    const pasted = [typeof body.model === "string" ? null : "the model JSON as model.json",
      typeof body.gpu === "string" ? null : "the GPU JSON as gpu.json"].filter(Boolean);
    $("share-status").textContent = pasted.length ? `Save ${pasted.join(" and ")} first.` : "";
    lastShare = { body, budget };
    const hash = `#s=${encodeURIComponent(JSON.stringify(formState()))}`;
    window.history.replaceState(null, "", hash);
  }

  // ---- what fits instead ------------------------------------------------------------------

  /** The ladder's keys of a whole training spec, as a runner-up's ``changes`` name them. */
  function ladderKeys(t) {
    const offload = { mode: t.offload.mode };
    if (t.offload.mode === "optimizer") offload.fraction = t.offload.fraction;
    if (t.offload.mode === "streaming") offload.checkpoint_every = t.offload.checkpoint_every || 1;
    return {
      micro_batch_size: t.micro_batch_size,
      grad_accum_steps: t.grad_accum_steps,
      "parallel.zero_stage": t.parallel.zero_stage,
      expandable_segments: t.expandable_segments,
      recompute: t.recompute,
      offload,
    };
  }

  function valueText(value) {
    if (value === null || typeof value !== "object") return String(value);
    return Object.entries(value).map(([k, v]) => `${k} ${v}`).join(", ");
  }

  function changesText(changes) {
    const parts = Object.entries(changes).map(([k, v]) => `${k}: ${valueText(v)}`);
    return parts.length ? parts.join("; ") : "none: this spec, as it is";
  }

  /** Set the form's fields to ``changes`` (a fit's ladder keys). */
  function setFields(changes) {
    for (const [key, value] of Object.entries(changes)) {
      if (key === "micro_batch_size" || key === "grad_accum_steps") $(key).value = String(value);
      else if (key === "parallel.zero_stage") $("zero_stage").value = String(value);
      else if (key === "expandable_segments") $("expandable_segments").checked = Boolean(value);
      else if (key === "recompute") {
        if (typeof value === "string") $("recompute").value = value;
        else {
          $("recompute").value = "every";
          $("recompute_every").value = String(value.every_k);
        }
      } else if (key === "offload") {
        $("offload_mode").value = value.mode;
        if (value.fraction !== undefined) $("offload_fraction").value = String(value.fraction);
        $("checkpoint_every").value = value.checkpoint_every ? String(value.checkpoint_every) : "";
        if (value.num_buffers !== undefined) $("num_buffers").value = String(value.num_buffers);
      }
    }
    syncDependentControls();
  }

  /** Set the form to a fit's ``changes``, then estimate again. */
  function applyChanges(changes) {
    setFields(changes);
    $("fit").hidden = true;
    update();
  }

  /** Set the form to a plan's row (its layout, batch shape, recompute, offload and the node
   *  it planned for), then estimate one of its ranks. */
  function applyPlan(c) {
    for (const k of ["dp", "tp", "pp", "vpp", "cp", "ep"]) {
      if (c.parallel[k] !== undefined) $(k).value = String(c.parallel[k]);
    }
    $("sequence_parallel").checked = Boolean(c.parallel.sequence_parallel);
    $("gpus_per_node").value = $("plan_gpus_per_node").value;
    setFields({
      micro_batch_size: c.micro_batch_size,
      grad_accum_steps: c.grad_accum_steps,
      "parallel.zero_stage": c.parallel.zero_stage,
      recompute: c.recompute,
      offload: c.offload,
    });
    update();
  }

  /** The plan's answer is for another request than the forms hold now: say so. */
  function markPlanStale() {
    let now = null;
    try {
      now = JSON.stringify(buildPlanRequest());
    } catch (err) {
      if (!(err instanceof InputError)) throw err;
    }
    const stale = planFor !== null && now !== planFor;
    $("plan").dataset.stale = String(stale);
    $("plan-stale").hidden = !stale;
  }

  function fitRow(changes, gpuPeak, tokensPerSecond, chosen) {
    const apply = el("button", { type: "button", class: "apply", textContent: "Apply" });
    apply.addEventListener("click", () => applyChanges(changes));
    return el("tr", {
      class: `plan-row${chosen ? " chosen" : ""}`,
      dataset: { changes: JSON.stringify(changes), peakBytes: String(gpuPeak) },
    }, [
      el("th", { scope: "row" }, [changesText(changes),
        ...(chosen ? [el("span", { class: "badge", textContent: "chosen" })] : [])]),
      el("td", { class: "num", textContent: `${fmtGiB(gpuPeak)} GiB` }),
      el("td", { class: "num", textContent: Math.round(tokensPerSecond).toLocaleString("en-US") }),
      el("td", {}, [apply]),
    ]);
  }

  async function runFit() {
    const answer = await panelRequest("fit", buildRequest, "fit", "fitting…", (body) => {
      fitFor = JSON.stringify(body);
    });
    if (answer === null) return;
    const { body, response, data } = answer;
    if (fitFor !== JSON.stringify(body)) return; // the form changed meanwhile: an old answer
    if (!response.ok || !data || data.fits === undefined) {
      panelRefused("fit", response, data);
      return;
    }
    const rows = [];
    if (data.fits) {
      // the form sends every ladder key: the chosen plan's changes are the keys that differ
      const asked = ladderKeys(body.train);
      const chosen = ladderKeys(data.plan);
      const changes = Object.fromEntries(Object.entries(chosen)
        .filter(([k, v]) => JSON.stringify(asked[k]) !== JSON.stringify(v)));
      rows.push(fitRow(changes, data.budget.gpu.peak_bytes, data.predicted_tokens_per_second, true));
      for (const r of data.runners_up) {
        rows.push(fitRow(r.changes, r.gpu_peak_bytes, r.tokens_per_second, false));
      }
    }
    $("fit-table").tBodies[0].replaceChildren(...rows);
    $("fit-table").hidden = !data.fits;
    $("fit-summary").textContent = data.fits
      ? `${data.candidates_fitting.toLocaleString("en-US")} of ` +
        `${data.candidates_considered.toLocaleString("en-US")} candidates fit; the fastest first.`
      : `Nothing fits: ${data.reason}`;
    $("fit").dataset.fits = String(data.fits);
    $("fit").dataset.state = "ok";
  }

  // ---- start -----------------------------------------------------------------------------

  function fillSelect(select, items, defaults) {
    select.replaceChildren(...items.map((item) => el("option", item)));
    const names = items.map((i) => i.value);
    const pick = defaults.find((d) => names.includes(d)) || names[0];
    if (pick !== undefined) select.value = pick;
  }

  function syncDependentControls() {
    const custom = $("model").value === CUSTOM;
    $("model-json-group").hidden = !custom;
    $("gpu-json-group").hidden = $("gpu").value !== CUSTOM;
    $("cluster-json-group").hidden = $("plan_cluster").value !== CUSTOM;
    // FSDP2 shards everything (ZeRO-3) and keeps its state on the GPU
    const fsdp2 = $("framework").value === "fsdp2";
    if (fsdp2) {
      $("zero_stage").value = "3";
      $("offload_mode").value = "none";
    }
    // DeepSpeed is ZeRO 1 and up, and offloads the optimizer only
    const deepspeed = $("framework").value === "deepspeed";
    if (deepspeed && $("zero_stage").value === "0") $("zero_stage").value = "1";
    if (deepspeed && $("offload_mode").value === "streaming") $("offload_mode").value = "none";
    $("zero_stage").querySelector('option[value="0"]').disabled = deepspeed;
    // Megatron shards its optimizer with its own distributed optimizer (ZeRO key 0)
    const megatron = $("framework").value === "megatron";
    if (megatron) $("zero_stage").value = "0";
    if (megatron && $("offload_mode").value === "streaming") $("offload_mode").value = "none";
    $("offload_mode").querySelector('option[value="streaming"]').disabled = deepspeed || megatron;
    $("zero_stage").disabled = fsdp2 || megatron;
    $("offload_mode").disabled = fsdp2;
    $("offload_fraction").disabled = fsdp2 || $("offload_mode").value !== "optimizer";
    const streaming = $("offload_mode").value === "streaming";
    $("checkpoint_every").disabled = !streaming;
    $("num_buffers").disabled = !streaming;
    $("recompute_every").disabled = $("recompute").value !== "every";
  }

  async function init() {
    const form = $("controls");
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      update();
    });
    $("fit-run").addEventListener("click", () => runFit());
    $("copy-cli").addEventListener("click", () => copy($("cli-command").textContent, "command"));
    $("copy-link").addEventListener("click", () => copy(window.location.href, "link"));
    $("download-spec").addEventListener("click", () => {
      if (lastShare) download("train.json", JSON.stringify(lastShare.body.train, null, 2));
    });
    $("download-budget").addEventListener("click", () => {
      if (lastShare) download("budget.json", JSON.stringify(lastShare.budget, null, 2));
    });
    $("plan-form").addEventListener("submit", (event) => {
      event.preventDefault();
      runPlan();
    });
    for (const type of ["input", "change"]) {
      form.addEventListener(type, () => {
        syncDependentControls();
        schedule();
        markPlanStale();
      });
      $("plan-form").addEventListener(type, () => {
        syncDependentControls();
        markPlanStale();
      });
    }

    let presets;
    try {
      const response = await fetch(`${API}/presets`, { headers: { Accept: "application/json" } });
      presets = await response.json();
      if (!response.ok) throw new Error(presets.detail || `HTTP ${response.status}`);
    } catch (err) {
      showError("Cannot load the presets", err.message);
      return;
    }
    const models = presets.models.map((m) => ({
      value: m.name, textContent: `${m.name} (${fmtParams(m.params_total)})`,
    }));
    models.push({ value: CUSTOM, textContent: "Custom: paste JSON…" });
    fillSelect($("model"), models, DEFAULT_MODELS);
    fillSelect($("gpu"), presets.gpus.map((g) => ({
      value: g.name, textContent: `${g.name} (${Math.round(g.memory_bytes / GIB)} GiB)`,
    })).concat([{ value: CUSTOM, textContent: "Custom: paste JSON…" }]), DEFAULT_GPUS);
    fillSelect($("plan_cluster"), [{ value: "", textContent: "the GPU's node preset" }]
      .concat((presets.clusters || []).map((c) => ({
        value: c.name, textContent: `${c.name} (${c.gpus_per_node}x ${c.gpu})`,
      })))
      .concat([{ value: CUSTOM, textContent: "Custom: paste JSON…" }]), [""]);
    const shared = readHashState();
    if (shared) restoreState(shared); // a link's form
    syncDependentControls();
    update();
  }

  document.addEventListener("DOMContentLoaded", init);
})();
