// What the playground page sends: server/http/playground/playground.js run in node over a minimal stand-in for the
// DOM (no browser here). Reads {"options": GET /playground/options's JSON, "cases": [{option: value, ...}, ...],
// "defaults": [POST /playground/defaults's JSON for each case's values, ...]} from stdin; builds the form from the
// options as the page does, and for each case resets the form, types each value into its field (as a user's input
// marks it), lets the page refresh its defaults (answered with the case's "defaults") and reads body(), the JSON
// the page would POST. Prints {"bodies": [...], "asked": [...], "shown": [...], "out_of_range": [...]}: asked is
// what the page sent to /playground/defaults, shown every option field's text before the submit, out_of_range
// the number fields whose value the browser would refuse to submit (outside min/max).
"use strict";

const fs = require("fs");
const path = require("path");
const vm = require("vm");

const input = JSON.parse(fs.readFileSync(0, "utf8"));
const elements = [];

class Element {
  constructor(tag, id = "") {
    Object.assign(this, { tagName: tag.toUpperCase(), id, children: [], dataset: {}, value: "", files: [],
      hidden: false, disabled: false, textContent: "", style: {} });
    this.classList = { add() {}, remove() {}, toggle() {} };
    elements.push(this);
  }
  append(...children) { this.children.push(...children); }
  replaceChildren(...children) { this.children = children; }
  addEventListener() {}
  setAttribute() {}
  removeAttribute() {}
  focus() {}
}

const byId = new Map();
const attr = (selector) => selector.match(/^\[data-([a-z]+)(?:="([^"]*)")?\]$/);
const document = {
  getElementById(id) {
    if (!byId.has(id)) byId.set(id, new Element("div", id));
    return byId.get(id);
  },
  createElement(tag) { return new Element(tag); },
  querySelectorAll(selector) {
    const m = attr(selector);
    if (!m) return [];
    return elements.filter((el) => m[1] in el.dataset && (m[2] === undefined || el.dataset[m[1]] === m[2]));
  },
  querySelector(selector) { return document.querySelectorAll(selector)[0] || null; },
};

let currentCase = 0;
const asked = [];

function respond(body) {
  return Promise.resolve({ ok: true, status: 200, statusText: "OK", headers: new Map(), json: async () => body });
}

const context = vm.createContext({
  document, console, URL, Headers, Number, JSON, Promise, setTimeout: () => 0, clearTimeout: () => {},
  location: { origin: "http://playground.test" },
  sessionStorage: { getItem: () => null, setItem() {} },
  Option: class { constructor(text, value) { this.text = text; this.value = value; } },
  fetch: (url, init = {}) => {
    if (String(url).includes("/playground/defaults")) {
      asked[currentCase] = JSON.parse(init.body);
      return respond(input.defaults[currentCase]);
    }
    return respond(String(url).includes("/playground/options") ? input.options : { data: [] });
  },
});
vm.runInContext(fs.readFileSync(path.join(__dirname, "../../../server/http/playground/playground.js"), "utf8"),
  context);

(async () => {
  await vm.runInContext("loadOptions()", context);
  const fields = document.querySelectorAll("[data-option]");
  const outOfRange = [];
  const bodies = [];
  const shownFields = [];
  for (const [index, values] of input.cases.entries()) {
    currentCase = index;
    for (const field of fields) {  // the page's Reset
      field.value = field.dataset.default = field.dataset.initial;
      delete field.dataset.touched;
    }
    document.getElementById("prompt").value = "after the fuzz";
    for (const [name, value] of Object.entries(values)) {
      const field = document.querySelector(`[data-option="${name}"]`);
      field.value = typeof value === "object" ? JSON.stringify(value) : String(value);
      field.dataset.touched = "1";  // what the page's input listener marks
    }
    if (Object.keys(values).length) await vm.runInContext("state.defaults = refreshDefaults()", context);
    const byName = (name) => document.querySelector(`[data-option="${name}"]`);  // the field the page reads
    shownFields.push(Object.fromEntries(fields.map((field) => [field.dataset.option, byName(field.dataset.option).value])));
    for (const field of fields) {
      if (field.type !== "number" || field.value === "") continue;
      const n = Number(field.value);
      if ((field.min !== undefined && n < Number(field.min)) || (field.max !== undefined && n > Number(field.max))) {
        outOfRange.push({ name: field.dataset.option, value: field.value, min: field.min, max: field.max });
      }
    }
    bodies.push(await vm.runInContext("body()", context));
  }
  process.stdout.write(JSON.stringify({ bodies, asked, shown: shownFields, out_of_range: outOfRange }));
})().catch((err) => {
  process.stderr.write(String(err && err.stack || err));
  process.exit(1);
});
