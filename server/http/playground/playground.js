// The playground page: drives /v1/videos from the browser. Everything it fetches is a relative URL of this
// server (api() refuses anything else), so the API key, once given, goes nowhere but here.
"use strict";

const KEY_ITEM = "cp-infer.api-key";
const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const LENGTH_OPTIONS = ["num_frames", "frame_rate"];
// What people set first, beside the prompt, image, length, seed and adapters; the rest fold under "Advanced".
const MAIN_OPTIONS = ["height", "width", "num_inference_steps", "guidance_scale"];
const $ = (id) => document.getElementById(id);

const state = { model: null, options: [], job: null, controller: null, thumbs: new Map(), poll: null,
  defaults: Promise.resolve(), defaultsAsked: 0 };

// -- the API, same origin only ----------------------------------------------------------------------------------

function api(path, init = {}) {
  if (typeof path !== "string" || !path.startsWith("/") || path.startsWith("//")) {
    throw new Error(`not a path of this server: ${path}`);
  }
  const url = new URL(path, location.origin);
  if (url.origin !== location.origin) throw new Error(`not a path of this server: ${path}`);
  const headers = new Headers(init.headers || {});
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  return fetch(url, { ...init, headers, credentials: "same-origin", cache: "no-store", redirect: "error" });
}

async function apiError(response) {
  let error = { code: `http_${response.status}`, message: response.statusText || "request failed", param: null };
  try {
    const body = await response.json();
    if (body && body.error) error = body.error;
  } catch (_) { /* not JSON: keep the status line */ }
  if (response.status === 401) askForKey();
  return error;
}

function showError(error) {
  $("error-code").textContent = error.code ? `${error.code}:` : "";
  $("error-message").textContent = error.message || "";
  $("error-param").textContent = error.param ? `(param: ${error.param})` : "";
  $("error").hidden = false;
  $("error").dataset.param = error.param || "";
  // A list's item (loras[1].scale) marks the list's field.
  const field = error.param ? error.param.replace(/\[.*$/, "") : "";
  for (const el of document.querySelectorAll("[data-param]")) {
    const bad = !!field && el.dataset.param === field;
    el.classList.toggle("invalid", bad);
    if (bad && $("advanced").contains(el)) $("advanced").open = true;  // the field named is shown
  }
}

function clearError() {
  $("error").hidden = true;
  for (const el of document.querySelectorAll(".invalid")) el.classList.remove("invalid");
}

async function failed(response) {
  showError(await apiError(response));
}

// -- the key ----------------------------------------------------------------------------------------------------

function askForKey() {
  $("key-panel").hidden = false;
  $("api-key").focus();
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_ITEM, key);
  $("api-key").value = "";
  if (await loadOptions()) {
    $("key-panel").hidden = true;
    refreshHistory();
  }
});
$("change-key").addEventListener("click", askForKey);

// -- the model's options ----------------------------------------------------------------------------------------

async function loadOptions() {
  const r = await api("/playground/options");
  if (!r.ok) {
    await failed(r);
    return false;
  }
  clearError();
  const info = await r.json();
  state.model = info;
  state.options = info.options;
  const layout = info.layout;
  $("model").textContent = `model: ${info.model}` + (layout ? ` · ${layout.replicas > 1 ? `${layout.replicas} ` +
    "replicas of " : ""}guidance ${layout.guidance} x ring ${layout.ring} x Ulysses ${layout.ulysses}` : "");
  $("options-model").textContent = info.model;
  $("change-key").hidden = !sessionStorage.getItem(KEY_ITEM);
  $("length-fields").replaceChildren();
  $("main-options").replaceChildren();
  $("options").replaceChildren();
  for (const option of info.options) {
    const parent = LENGTH_OPTIONS.includes(option.name) ? $("length-fields")
      : MAIN_OPTIONS.includes(option.name) ? $("main-options") : $("options");
    parent.append(optionField(option));
  }
  $("live-row").hidden = !info.live;
  if (!info.live) $("live").checked = false;
  // A direction's image: where each window may start from one of its own (Wan image-to-video).
  $("direction-image-row").hidden = !info.window_images;
  $("direction-image").value = "";
  if (info.max_prompt_chars) $("prompt").maxLength = info.max_prompt_chars;
  adapterFields(info.loras);
  lengthHint();
  $("generate").disabled = false;
  return true;
}

function shown(value) {
  if (value === null || value === undefined) return "";
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

function optionField(option) {
  const wrap = document.createElement("div");
  wrap.className = "pair";
  const id = `opt-${option.name}`;
  const label = document.createElement("label");
  label.htmlFor = id;
  label.textContent = option.name;
  let input;
  if (option.type === "boolean") {
    input = document.createElement("select");
    for (const [value, text] of [["true", "true"], ["false", "false"]]) {
      input.append(new Option(text, value));
    }
  } else {
    input = document.createElement("input");
    if (option.type === "integer" || option.type === "number") {
      input.type = "number";
      input.step = option.type === "integer" ? String(option.multiple_of || 1) : "any";
      if (option.minimum !== null) input.min = String(option.minimum);
      if (option.maximum !== null) input.max = String(option.maximum);
    } else {
      input.type = "text";
    }
    input.placeholder = option.default === null ? "unset" : "";
  }
  input.id = id;
  input.dataset.option = option.name;
  input.dataset.param = option.name;
  input.dataset.initial = shown(option.default);
  input.dataset.default = shown(option.default);
  input.value = shown(option.default);
  input.title = option.help;
  input.addEventListener("input", () => {
    input.dataset.touched = "1";
    lengthHint();
    state.defaults = refreshDefaults();
  });
  const help = document.createElement("small");
  help.className = "help";
  const initial = option.default === null ? "unset" : option.default === "" ? '""' : shown(option.default);
  help.textContent = `${option.help}. Default ${initial}; `
    + `${option.accepts}.`;
  wrap.append(label, input, help);
  return wrap;
}

function adapterFields(loras) {
  // One row per adapter of the server's --lora-dir: a checkbox to apply it and its scale.
  const adapters = (loras && loras.adapters) || [];
  $("loras").hidden = adapters.length === 0;
  $("lora-fields").replaceChildren();
  if (!adapters.length) return;
  const [lo, hi] = loras.scale;
  $("loras-hint").textContent = `Apply up to ${loras.max} at once; scale from ${lo} to ${hi}.`;
  for (const name of adapters) {
    const wrap = document.createElement("div");
    wrap.className = "pair";
    const label = document.createElement("label");
    const on = document.createElement("input");
    on.type = "checkbox";
    on.id = `lora-${name}`;
    on.dataset.lora = name;
    label.append(on, ` ${name}`);
    const scale = document.createElement("input");
    scale.type = "number";
    scale.step = "any";
    scale.min = String(lo);
    scale.max = String(hi);
    scale.value = "1";
    scale.id = `lora-${name}-scale`;
    scale.title = `scale of ${name}`;
    scale.setAttribute("aria-label", `scale of ${name}`);
    wrap.append(label, scale);
    $("lora-fields").append(wrap);
  }
}

function chosenLoras() {
  const out = [];
  for (const on of document.querySelectorAll("[data-lora]")) {
    if (!on.checked) continue;
    const text = $(`${on.id}-scale`).value.trim();
    const n = Number(text);
    out.push({ name: on.dataset.lora, scale: text !== "" && Number.isFinite(n) ? n : text });
  }
  return out;
}

function optionValue(name) {
  const input = document.querySelector(`[data-option="${name}"]`);
  return input ? input.value : "";
}

function windowsOf(frames) {
  // As models/common/windows.py cuts a long video: windows of tile latent frames that start tile - overlap apart; a tile
  // of 8k frames is k latent frames (LTX), one of 4k+1 frames k+1 (Wan: window_tile_causal).
  const t = state.model.temporal_compression || 8;
  // A model without temporal_overlap chains its windows on one latent frame (Wan image-to-video folders).
  const tileFrames = Number(optionValue("temporal_tile_size"));
  const overlapText = optionValue("temporal_overlap");
  const overlap = overlapText === "" ? 1 : Math.floor(Number(overlapText) / t);
  if (!tileFrames || !Number.isFinite(overlap)) return 1;
  const latent = Math.floor((frames - 1) / t) + 1;
  const tile = Math.max(1, state.model.window_tile_causal ? Math.floor((tileFrames - 1) / t) + 1
    : Math.floor(tileFrames / t));
  if (latent <= tile) return 1;
  const stride = Math.max(tile - overlap, 1);
  let count = 1;
  for (let start = 0; start + tile < latent; start += stride) count += 1;
  return count;
}

function lengthHint() {
  if (!state.model) return;
  const frames = Number(optionValue("num_frames"));
  const fps = Number(optionValue("frame_rate")) || 25;
  if (!frames || frames < 1) {
    $("length-hint").textContent = "";
    return;
  }
  const windows = windowsOf(frames);
  const made = windows > 1 ? `made in ${windows} windows of ${optionValue("temporal_tile_size")} frames`
    : "made at once (one window)";
  $("length-hint").textContent = `${frames} frames = ${(frames / fps).toFixed(2)} s at ${fps} fps; ${made}.`;
  $("length-hint").dataset.windows = String(windows);
}

$("reset").addEventListener("click", () => {
  state.defaultsAsked += 1;  // an answer still on its way is for values no longer shown
  for (const input of document.querySelectorAll("[data-option]")) {
    input.value = input.dataset.default = input.dataset.initial;
    delete input.dataset.touched;
  }
  for (const on of document.querySelectorAll("[data-lora]")) {
    on.checked = false;
    $(`${on.id}-scale`).value = "1";
  }
  $("seed").value = "";
  $("live").checked = false;
  lengthHint();
});

function givenValue(option, input) {
  // What a field gives the API: undefined when it gives nothing (left empty where the default is unset).
  const text = input.value.trim();
  if (text === "" && option.default === null) return undefined;
  return text === "" ? null : parsed(option, text);
}

async function refreshDefaults() {
  // A default may follow what the user changed (height and width are lowered further under stages=2): the API's
  // own resolution (POST /playground/defaults) gives them, and the fields the user left alone show them, so that
  // a field the page leaves unsent is what the job gets. A value the API refuses changes nothing here: its error
  // comes when the job is submitted.
  const asked = ++state.defaultsAsked;
  const given = {};
  for (const option of state.options) {
    const input = document.querySelector(`[data-option="${option.name}"]`);
    const value = input.dataset.touched === "1" ? givenValue(option, input) : undefined;
    if (value !== undefined) given[option.name] = value;
  }
  const r = await api("/playground/defaults", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(given),
  });
  if (!r.ok || asked !== state.defaultsAsked) return;
  const { defaults } = await r.json();
  for (const option of state.options) {
    const input = document.querySelector(`[data-option="${option.name}"]`);
    if (input.dataset.touched === "1" || !(option.name in defaults)) continue;
    input.value = input.dataset.default = shown(defaults[option.name]);
  }
  lengthHint();
}

function parsed(option, text) {
  // A value the API is given as typed: numbers as numbers, lists as JSON; anything that does not parse is sent
  // as the string it is, so that the API's own error names it.
  if (option.type === "integer" || option.type === "number") {
    const n = Number(text);
    return Number.isFinite(n) ? n : text;
  }
  if (option.type === "boolean") return text === "true";
  if (option.type === "integers" || option.type === "numbers" || option.type === "objects") {
    try { return JSON.parse(text); } catch (_) { return text; }
  }
  return text;
}

function readFile(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function body() {
  await state.defaults;  // the defaults shown are those of the values the user changed
  const out = { prompt: $("prompt").value };
  for (const option of state.options) {
    // Sent: what the user changed, and any field that no longer shows its default; a field left alone shows
    // what the API fills in without it.
    const input = document.querySelector(`[data-option="${option.name}"]`);
    if (input.dataset.touched !== "1" && input.value.trim() === input.dataset.default) continue;
    const value = givenValue(option, input);
    if (value !== undefined) out[option.name] = value;
  }
  const seed = $("seed").value.trim();
  if (seed !== "") out.seed = Number.isFinite(Number(seed)) ? Number(seed) : seed;
  const loras = chosenLoras();
  if (loras.length) out.loras = loras;
  const file = $("image").files[0];
  if (file) out.input_reference = await readFile(file);
  if (!$("live-row").hidden && $("live").checked) out.live = true;
  return out;
}

$("image-clear").addEventListener("click", () => { $("image").value = ""; });

// -- one job: create it streamed, follow its events, play its MP4 as it comes ----------------------------------

$("create").addEventListener("submit", async (event) => {
  event.preventDefault();
  if (state.controller) return;
  clearError();
  const controller = new AbortController();
  state.controller = controller;
  $("generate").disabled = true;
  try {
    const payload = JSON.stringify(await body());
    const r = await api("/v1/videos?stream=true", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: payload, signal: controller.signal,
    });
    if (!r.ok) {
      await failed(r);
      return;
    }
    const id = r.headers.get("X-Video-Id");
    setJob({ id, status: "queued", progress: 0, window: null, windows: null });
    $("cancel").disabled = false;
    follow(id, controller.signal);
    refreshHistory();
    try {
      await playStream(r, id);
    } catch (err) {
      // A job that fails or is cancelled ends its stream short; its events say how it ended.
      if (err instanceof PlaybackError) throw err;
    }
  } catch (err) {
    if (err.name !== "AbortError") showError({ code: "client_error", message: String(err.message || err), param: null });
  } finally {
    if (state.controller === controller) state.controller = null;
    $("generate").disabled = !state.model;
  }
});

function setJob(job) {
  state.job = job;
  const current = $("current");
  current.dataset.job = job.id;
  current.dataset.status = job.status;
  $("progress").value = job.progress || 0;
  const parts = [`${job.id}: ${job.status.replace("_", " ")}`, `${job.progress || 0}%`];
  if (job.windows) parts.push(`window ${Math.min((job.window ?? 0) + 1, job.windows)} of ${job.windows}`);
  if (job.error) parts.push(`${job.error.code}: ${job.error.message}`);
  $("status").textContent = parts.join(" · ");
  if (TERMINAL.has(job.status)) {
    $("cancel").disabled = true;
    refreshHistory();
  }
  showDirections(job);
}

// -- a live video: its directions, a timeline of its windows ----------------------------------------------------

function showDirections(job) {
  const live = job.live;
  $("director").hidden = !live;
  if (!live) return;
  const open = !TERMINAL.has(job.status) && !live.ended;
  $("direct").disabled = $("end-live").disabled = !open;
  const items = [];
  for (const d of live.directions) {
    for (let w = d.start_window; w <= d.end_window; w++) {
      const where = w < live.windows_made ? "made"
        : job.status === "in_progress" && !live.waiting && w === job.window ? "in_progress" : "queued";
      const li = document.createElement("li");
      li.dataset.window = String(w);
      li.dataset.state = where;
      const image = d.image && w === d.start_window;
      if (image) li.dataset.image = "1";
      li.textContent = `${d.prompt}${image ? " [from an image]" : ""} (${where.replace("_", " ")})`;
      items.push(li);
    }
  }
  $("timeline").replaceChildren(...items);
  $("live-hint").textContent = !open ? (live.ended && !TERMINAL.has(job.status) ? "Ending after what is directed."
    : "") : live.waiting ? "Every directed window is made: what happens next?"
    : "A direction applies from the first window not yet started.";
}

async function direct(payload) {
  if (!state.job) return;
  clearError();
  const r = await api(`/v1/videos/${encodeURIComponent(state.job.id)}/directions`, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(payload),
  });
  if (!r.ok) return failed(r);
  const job = await r.json();
  if (state.job && state.job.id === job.id) setJob(job);
  return job;
}

$("direct-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  // Sent as typed: the API names what is wrong (an empty prompt, windows below 1).
  const payload = { prompt: $("direction").value };
  const text = $("direction-windows").value.trim();
  if (text !== "") payload.windows = Number.isFinite(Number(text)) ? Number(text) : text;
  const file = $("direction-image-row").hidden ? undefined : $("direction-image").files[0];
  if (file) payload.image = await readFile(file);
  if (await direct(payload)) $("direction").value = $("direction-image").value = "";
});
$("direction-image-clear").addEventListener("click", () => { $("direction-image").value = ""; });
$("end-live").addEventListener("click", () => direct({ end: true }));

async function follow(id, signal) {
  // Server-sent events over fetch (an EventSource cannot send the Authorization header).
  let r;
  try {
    r = await api(`/v1/videos/${encodeURIComponent(id)}/events`, { signal });
  } catch (_) { return; }
  if (!r.ok) return failed(r);
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data && state.job && state.job.id === id) setJob(JSON.parse(data));
      }
    }
  } catch (_) { /* aborted, or the server went away: the history still shows the job */ }
}

class PlaybackError extends Error {}

function boxes(bytes) {
  // The top-level MP4 boxes in bytes: [type, start, end] of each complete one.
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = [];
  let at = 0;
  while (at + 8 <= bytes.length) {
    let size = view.getUint32(at);
    const type = String.fromCharCode(...bytes.subarray(at + 4, at + 8));
    if (size === 1) {
      if (at + 16 > bytes.length) break;
      size = Number(view.getBigUint64(at + 8));
    } else if (size === 0) {
      size = bytes.length - at;
    }
    if (size < 8 || at + size > bytes.length) break;
    out.push([type, at, at + size]);
    at += size;
  }
  return out;
}

function find(bytes, text, from = 0, to = bytes.length) {
  const codes = [...text].map((c) => c.charCodeAt(0));
  outer: for (let i = from; i + codes.length <= to; i++) {
    for (let j = 0; j < codes.length; j++) if (bytes[i + j] !== codes[j]) continue outer;
    return i;
  }
  return -1;
}

function mimeType(bytes, moovEnd) {
  // The codecs string from the init segment itself: avc1.PPCCLL from the avcC box (profile, constraints, level).
  const hex = (b) => b.toString(16).padStart(2, "0");
  const codecs = [];
  const avcc = find(bytes, "avcC", 0, moovEnd);
  if (avcc >= 0) codecs.push(`avc1.${hex(bytes[avcc + 5])}${hex(bytes[avcc + 6])}${hex(bytes[avcc + 7])}`);
  if (find(bytes, "mp4a", 0, moovEnd) >= 0) codecs.push("mp4a.40.2");
  return `video/mp4; codecs="${codecs.join(", ")}"`;
}

function concat(a, b) {
  const out = new Uint8Array(a.length + b.length);
  out.set(a, 0);
  out.set(b, a.length);
  return out;
}

async function playStream(response, id) {
  const player = $("player");
  const source = new MediaSource();
  player.removeAttribute("src");
  player.src = URL.createObjectURL(source);
  await new Promise((resolve) => source.addEventListener("sourceopen", resolve, { once: true }));
  const reader = response.body.getReader();
  const queue = [];
  let buffer = null;
  let head = new Uint8Array(0);
  let ended = false;
  const pump = () => {
    if (!buffer || buffer.updating || source.readyState !== "open") return;
    if (queue.length) buffer.appendBuffer(queue.shift());
    else if (ended) source.endOfStream();
  };
  for (;;) {
    const { done, value } = await reader.read();  // rejects if the job ends other than completed
    if (done) break;
    if (!buffer) {
      head = concat(head, value);
      const moov = boxes(head).find(([type]) => type === "moov");
      if (!moov) continue;
      const type = mimeType(head, moov[2]);
      if (!MediaSource.isTypeSupported(type)) throw new PlaybackError(`this browser cannot play ${type}`);
      buffer = source.addSourceBuffer(type);
      buffer.addEventListener("updateend", pump);
      queue.push(head);
    } else {
      queue.push(value);
    }
    pump();
    if (player.paused && state.job && state.job.id === id) player.play().catch(() => {});
  }
  ended = true;
  pump();
}

$("cancel").addEventListener("click", () => { if (state.job) cancelJob(state.job.id); });

// -- history ----------------------------------------------------------------------------------------------------

async function cancelJob(id) {
  const r = await api(`/v1/videos/${encodeURIComponent(id)}/cancel`, { method: "POST" });
  if (!r.ok) return failed(r);
  refreshHistory();
}

async function deleteJob(id) {
  const r = await api(`/v1/videos/${encodeURIComponent(id)}`, { method: "DELETE" });
  if (!r.ok) return failed(r);
  const url = state.thumbs.get(id);
  if (url) URL.revokeObjectURL(url);
  state.thumbs.delete(id);
  refreshHistory();
}

async function contentBlob(id, variant) {
  const r = await api(`/v1/videos/${encodeURIComponent(id)}/content?variant=${variant}`);
  if (!r.ok) {
    await failed(r);
    return null;
  }
  return r.blob();
}

async function playJob(id) {
  const blob = await contentBlob(id, "video");
  if (!blob) return;
  const player = $("player");
  player.src = URL.createObjectURL(blob);
  player.play().catch(() => {});
}

async function downloadJob(id) {
  const blob = await contentBlob(id, "video");
  if (!blob) return;
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `${id}.mp4`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
}

async function thumbnail(img, id) {
  if (!state.thumbs.has(id)) {
    const r = await api(`/v1/videos/${encodeURIComponent(id)}/content?variant=thumbnail`);
    if (!r.ok) return;
    state.thumbs.set(id, URL.createObjectURL(await r.blob()));
  }
  img.src = state.thumbs.get(id);
}

function button(text, action, cls) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.className = cls;
  b.addEventListener("click", action);
  return b;
}

let refreshing = null;
function refreshHistory() {
  refreshing = (refreshing || Promise.resolve()).then(renderHistory, renderHistory);
  return refreshing;
}

async function renderHistory() {
  const r = await api("/v1/videos?limit=20");
  if (!r.ok) return failed(r);
  const { data } = await r.json();
  const items = data.map((job) => {
    const li = document.createElement("li");
    li.dataset.id = job.id;
    li.dataset.status = job.status;
    const img = document.createElement("img");
    img.className = "thumb";
    img.alt = job.status === "completed" ? `thumbnail of ${job.id}` : job.status;
    if (job.status === "completed") thumbnail(img, job.id);
    const meta = document.createElement("div");
    meta.className = "meta";
    const prompt = document.createElement("div");
    prompt.className = "prompt";
    prompt.textContent = job.prompt.length > 120 ? `${job.prompt.slice(0, 120)}…` : job.prompt;
    const info = document.createElement("div");
    info.className = "muted";
    const windows = job.windows ? ` · ${job.windows} windows` : "";
    const image = job.input_reference ? " · from an image" : "";
    info.textContent = `${job.status.replace("_", " ")} ${job.progress}% · ${job.size} · ${job.seconds} s${windows}`
      + `${image} · ${job.id}`;
    meta.append(prompt, info);
    if (job.error) {
      const error = document.createElement("div");
      error.className = "muted";
      error.textContent = `${job.error.code}: ${job.error.message}`;
      meta.append(error);
    }
    const buttons = document.createElement("div");
    buttons.className = "buttons";
    if (job.status === "completed") {
      buttons.append(button("Play", () => playJob(job.id), "play"), button("Download", () => downloadJob(job.id),
        "download"));
    } else if (!TERMINAL.has(job.status)) {
      buttons.append(button("Cancel", () => cancelJob(job.id), "cancel"));
    }
    buttons.append(button("Delete", () => deleteJob(job.id), "delete"));
    li.append(img, meta, buttons);
    return li;
  });
  $("jobs").replaceChildren(...items);
  clearTimeout(state.poll);
  if (data.some((job) => !TERMINAL.has(job.status))) state.poll = setTimeout(refreshHistory, 1000);
}

$("refresh").addEventListener("click", refreshHistory);

(async () => {
  if (await loadOptions()) refreshHistory();
})();
