// Runs a page's inline script against a minimal DOM (no browser needed) and prints what it built:
// node dom_stub.js PAGE_SCRIPT.js DATA.json -> JSON lines {tag, attrs, text} of every element created.
const fs = require("fs");
const [script, dataPath] = process.argv.slice(2);
const made = [];
function element(tag) {
  const e = {tag, attrs: {}, children: [], textContent: "",
             setAttribute(k, v) { this.attrs[k] = String(v); }, appendChild(c) { this.children.push(c); return c; }};
  made.push(e);
  return e;
}
const nodes = {"ledger-data": {textContent: fs.readFileSync(dataPath, "utf8")}};
global.document = {
  getElementById(id) { return nodes[id] || (nodes[id] = element("div#" + id)); },
  createElement: element, createElementNS: (ns, tag) => element(tag),
};
eval(fs.readFileSync(script, "utf8"));
for (const e of made) console.log(JSON.stringify({tag: e.tag, attrs: e.attrs, text: e.textContent}));
