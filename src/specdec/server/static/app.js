// specdec playground: races plain and speculative decoding of one prompt over the public streaming API
// (fetch + ReadableStream over SSE), colours each speculative token by how it came about, and turns the
// measured acceptance into expected tokens per step and speed-up per k.
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);
const KINDS = ["accepted", "recovered", "bonus", "target"];
const CALC_KS = [1, 2, 3, 4, 5, 6, 7, 8];
const STATUS_POLL_MS = 400;

const page = {
  info: null,  // /v1/specdec/info
  controllers: [],  // AbortControllers of the running requests
  measured: { alpha: null, c: null },
  edited: { alpha: false, c: false },  // the user typed a value: measurements no longer overwrite it
};

// ---- server ------------------------------------------------------------------------------------------
function headers() {
  const key = $("#api-key").value.trim();
  const result = { "Content-Type": "application/json" };
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function loadInfo() {
  const response = await fetch("/v1/specdec/info", { headers: headers() });
  if (!response.ok) throw new Error(`/v1/specdec/info: ${await errorMessage(response)}`);
  page.info = await response.json();
  const info = page.info;
  const method = $("#method");
  method.replaceChildren();
  if (info.speculative) {
    const kText = info.num_speculative_tokens == null ? "" : ` (k=${info.num_speculative_tokens})`;
    method.append(new Option(`${info.method || "speculative"}${kText}`, "spec"));
  }
  method.append(new Option("plain (no drafts)", "plain"));
  $("#k").value = info.num_speculative_tokens ?? "";
  $("#calc-k").textContent = info.num_speculative_tokens ?? "?";
  $("#server-info").textContent = `model ${info.model} · ` + (info.speculative
    ? `speculative method ${info.method || "(custom drafter)"}, k = ${info.num_speculative_tokens ?? "?"}`
    : "no drafter: plain decoding only") + ` · context ${info.max_model_len}`;
  $("#run").disabled = false;
  document.body.dataset.ready = "true";
}

async function engineSpecCounters() {
  const response = await fetch("/status");
  if (!response.ok) return null;
  const spec = (await response.json()).spec_decode;
  return { drafted: spec.drafted_tokens, accepted: spec.accepted_tokens, steps: spec.verify_steps };
}

// One streaming request; onChoice(choice) for every chunk that carries a choice.
async function streamCompletion(body, signal, onChoice) {
  const endpoint = $("#endpoint").value;
  const prompt = $("#prompt").value;
  const payload = { ...body, model: page.info.model, stream: true };
  if (endpoint === "chat") payload.messages = [{ role: "user", content: prompt }];
  else payload.prompt = prompt;
  const response = await fetch(endpoint === "chat" ? "/v1/chat/completions" : "/v1/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(payload), signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) onChoice(choice);
      }
    }
  }
}

// Control characters as their Unicode "control pictures" (newlines and tabs stay), an empty token (EOS) as ∅.
function visible(text) {
  if (!text) return "∅";
  return text.replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g,
    (ch) => String.fromCharCode(ch === "\u007f" ? 0x2421 : 0x2400 + ch.charCodeAt(0)));
}

// ---- one lane of the race ----------------------------------------------------------------------------
class Lane {
  constructor(element) {
    this.element = element;
    this.output = $(".output", element);
  }

  reset(state) {
    this.output.replaceChildren();
    this.counts = { accepted: 0, recovered: 0, bonus: 0, target: 0 };
    this.tokens = 0;
    this.tokenChunks = 0;  // chunks that carried tokens (= engine steps for this request)
    this.startedAt = null;
    this.firstTokenAt = null;
    this.lastTokenAt = null;
    this.tokensAtFirstChunk = 0;
    this.finishedAt = null;
    this.setState(state);
    this.render();
  }

  setState(state) {
    this.element.dataset.state = state;
    $(".state", this.element).textContent = state;
  }

  start() {
    this.startedAt = performance.now();
    this.setState("streaming");
  }

  add(choice) {
    const kinds = choice.token_kinds || [];
    if (!kinds.length) return;
    const now = performance.now();
    const positions = choice.draft_positions || [];
    const texts = choice.token_texts || [];
    const fragment = document.createDocumentFragment();
    kinds.forEach((kind, i) => {
      const span = document.createElement("span");
      const text = texts[i] ?? "";
      span.className = text ? `tok tok-${kind}` : `tok tok-${kind} tok-empty`;
      span.textContent = visible(text);
      span.title = positions[i] == null ? `${kind} (no draft)` : `${kind} · draft position ${positions[i]}`;
      if (positions[i] != null) span.dataset.draftPosition = positions[i];
      fragment.append(span);
      this.counts[kind] = (this.counts[kind] || 0) + 1;
    });
    this.output.append(fragment);
    this.output.scrollTop = this.output.scrollHeight;
    if (this.firstTokenAt === null) {
      this.firstTokenAt = now;
      this.tokensAtFirstChunk = kinds.length;
    } else {
      this.tokenChunks += 1;
    }
    this.lastTokenAt = now;
    this.tokens += kinds.length;
  }

  finish(state) {
    this.finishedAt = performance.now();
    this.setState(state);
    this.render();
  }

  elapsedS(now = performance.now()) {
    if (this.startedAt === null) return 0;
    return ((this.finishedAt ?? now) - this.startedAt) / 1000;
  }

  tokensPerSecond() {
    const elapsed = this.elapsedS();
    return elapsed > 0 && this.tokens ? this.tokens / elapsed : null;
  }

  // Decode time per engine step, without the prompt's prefill (first chunk).
  stepTimeS() {
    if (!this.tokenChunks) return null;
    return (this.lastTokenAt - this.firstTokenAt) / 1000 / this.tokenChunks;
  }

  tokenTimeS() {
    const decoded = this.tokens - this.tokensAtFirstChunk;
    if (!decoded) return null;
    return (this.lastTokenAt - this.firstTokenAt) / 1000 / decoded;
  }

  render() {
    const tps = this.tokensPerSecond();
    $(".tps", this.element).textContent = tps === null ? "–" : tps.toFixed(1);
    $(".ntok", this.element).textContent = this.tokens;
    $(".elapsed", this.element).textContent = this.elapsedS().toFixed(2);
  }
}

// ---- statistics and the calculator -------------------------------------------------------------------
function fmt(value, digits = 2) {
  return value === null || value === undefined || !Number.isFinite(value) ? "–" : value.toFixed(digits);
}

function updateStats(plain, spec, engineDelta) {
  const { accepted, recovered, bonus, target } = spec.counts;
  const verifySteps = recovered + bonus;  // each verify step with a draft ends in one recovered or bonus token
  const alpha = accepted + recovered ? accepted / (accepted + recovered) : null;
  const tau = verifySteps ? 1 + accepted / verifySteps : null;
  const plainTps = plain.tokensPerSecond();
  const specTps = spec.tokensPerSecond();
  const plainTokenS = plain.tokenTimeS();
  const specStepS = spec.stepTimeS();
  const c = plainTokenS && specStepS ? specStepS / plainTokenS : null;
  $("#stat-alpha").textContent = fmt(alpha, 3);
  $("#stat-engine-alpha").textContent = engineDelta && engineDelta.drafted
    ? fmt(engineDelta.accepted / engineDelta.drafted, 3) : "–";
  $("#stat-tau").textContent = fmt(tau);
  $("#stat-draft-length").textContent = engineDelta && engineDelta.steps
    ? fmt(engineDelta.drafted / engineDelta.steps) : "–";
  $("#stat-steps").textContent = verifySteps || "–";
  $("#stat-counts").textContent = `${accepted} accepted · ${recovered} recovered · ${bonus} bonus · ${target} target`;
  $("#stat-speedup").textContent = plainTps && specTps ? `${fmt(specTps / plainTps)}×` : "–";
  $("#stat-c").textContent = fmt(c);
  page.measured = { alpha, c };
  fillMeasured(false);
}

function fillMeasured(force) {
  const { alpha, c } = page.measured;
  if (alpha !== null && (force || !page.edited.alpha)) $("#calc-alpha").value = Math.min(alpha, 0.999).toFixed(3);
  if (c !== null && (force || !page.edited.c)) $("#calc-c").value = c.toFixed(3);
  if (force) page.edited = { alpha: false, c: false };
  renderCalculator();
}

function expectedTokensPerStep(alpha, k) {
  return alpha >= 1 ? k + 1 : (1 - alpha ** (k + 1)) / (1 - alpha);
}

function renderCalculator() {
  const alpha = Math.min(Math.max(Number($("#calc-alpha").value) || 0, 0), 1);
  const c = Math.max(Number($("#calc-c").value) || 1, 0.01);
  const serverK = page.info?.num_speculative_tokens || null;
  const perDraftToken = serverK ? (c - 1) / serverK : c - 1;  // c(k) = 1 + perDraftToken * k
  const rows = CALC_KS.map((k) => {
    const expected = expectedTokensPerStep(alpha, k);
    const cost = Math.max(1 + perDraftToken * k, 0.01);
    const row = document.createElement("tr");
    if (k === serverK) row.className = "server-k";
    row.dataset.k = k;
    for (const text of [String(k), fmt(expected), fmt(cost), `${fmt(expected / cost)}×`]) {
      row.append(Object.assign(document.createElement("td"), { textContent: text }));
    }
    return row;
  });
  $("#calc-table tbody").replaceChildren(...rows);
}

// ---- the race ----------------------------------------------------------------------------------------
function showError(message) {
  const box = $("#error");
  box.hidden = !message;
  box.textContent = message || "";
}

async function runLane(lane, speculative, signal) {
  const body = {
    temperature: Number($("#temperature").value),
    max_tokens: Number($("#max-tokens").value),
    speculative,
    return_token_kinds: true,
  };
  lane.start();
  try {
    await streamCompletion(body, signal, (choice) => { lane.add(choice); lane.render(); });
    lane.finish("done");
  } catch (error) {
    lane.finish(error.name === "AbortError" ? "stopped" : "error");
    if (error.name !== "AbortError") throw error;
  }
}

async function race() {
  showError("");
  const plain = lanes.plain;
  const spec = lanes.spec;
  const speculative = $("#method").value === "spec";
  $(".lane-title", spec.element).textContent = speculative ? "Speculative decoding" : "Plain decoding (control)";
  $(".lane-sub", spec.element).textContent = speculative
    ? `${page.info.method || "drafter"}, k = ${page.info.num_speculative_tokens ?? "?"}` : '"speculative": false';
  plain.reset("waiting");
  spec.reset("waiting");
  document.body.dataset.state = "running";
  $("#run").disabled = true;
  $("#stop").disabled = false;
  page.controllers = [new AbortController(), new AbortController()];
  const before = await engineSpecCounters();
  let engineDelta = null;
  const refresh = async () => {
    const now = await engineSpecCounters();
    if (before && now) {
      engineDelta = { drafted: now.drafted - before.drafted, accepted: now.accepted - before.accepted,
                      steps: now.steps - before.steps };
    }
  };
  const ticker = setInterval(() => { plain.render(); spec.render(); updateStats(plain, spec, engineDelta); }, 100);
  const poller = setInterval(refresh, STATUS_POLL_MS);
  try {
    if ($("#sequential").checked) {
      await runLane(plain, false, page.controllers[0].signal);
      await runLane(spec, speculative, page.controllers[1].signal);
    } else {
      await Promise.all([runLane(plain, false, page.controllers[0].signal),
                         runLane(spec, speculative, page.controllers[1].signal)]);
    }
  } catch (error) {
    page.controllers.forEach((controller) => controller.abort());
    showError(error.message);
  } finally {
    clearInterval(ticker);
    clearInterval(poller);
    await refresh();
    plain.render();
    spec.render();
    updateStats(plain, spec, engineDelta);
    $("#run").disabled = false;
    $("#stop").disabled = true;
    document.body.dataset.state = "done";
  }
}

const lanes = { plain: new Lane($("#lane-plain")), spec: new Lane($("#lane-spec")) };

function init() {
  lanes.plain.reset("idle");
  lanes.spec.reset("idle");
  $("#run").addEventListener("click", () => race());
  $("#stop").addEventListener("click", () => page.controllers.forEach((controller) => controller.abort()));
  $("#calc-alpha").addEventListener("input", () => { page.edited.alpha = true; renderCalculator(); });
  $("#calc-c").addEventListener("input", () => { page.edited.c = true; renderCalculator(); });
  $("#use-measured").addEventListener("click", () => fillMeasured(true));
  $("#api-key").addEventListener("change", () => loadInfo().then(() => showError("")).catch((e) => showError(e.message)));
  renderCalculator();
  loadInfo().then(renderCalculator).catch((error) => showError(error.message));
}

init();
