// Extracts the gateway's method -> scope table from an installed `openclaw`
// package (its bundled dist keeps the source's `CORE_GATEWAY_METHOD_SPECS`
// array from src/gateway/methods/core-descriptors.ts), as the TSV that
// src/policy/methods.rs embeds.
//   node tools/extract-gateway-policy.mjs <openclaw package dir> > src/policy/gateway-methods.tsv
import fs from "node:fs";
import path from "node:path";

const pkg = process.argv[2];
if (!pkg) {
  console.error("usage: extract-gateway-policy.mjs <openclaw package dir>");
  process.exit(2);
}
const version = JSON.parse(fs.readFileSync(path.join(pkg, "package.json"), "utf8")).version;
const dist = path.join(pkg, "dist");
const file = fs
  .readdirSync(dist)
  .filter((f) => f.startsWith("method-scopes-") && f.endsWith(".mjs"))
  .map((f) => path.join(dist, f))
  .find((f) => fs.readFileSync(f, "utf8").includes("const CORE_GATEWAY_METHOD_SPECS = ["));
if (!file) {
  console.error("CORE_GATEWAY_METHOD_SPECS not found in dist/method-scopes-*.mjs");
  process.exit(1);
}
const text = fs.readFileSync(file, "utf8");
const start = text.indexOf("const CORE_GATEWAY_METHOD_SPECS = [") + "const CORE_GATEWAY_METHOD_SPECS = ".length;
const end = text.indexOf("\n];", start) + 2;
const CONTROL_PLANE_WRITE = { controlPlaneWrite: true };
const specs = new Function("CONTROL_PLANE_WRITE", `return ${text.slice(start, end)};`)(CONTROL_PLANE_WRITE);
console.log(`# method\tscope — openclaw ${version}, src/gateway/methods/core-descriptors.ts (${specs.length} methods)`);
console.log("# scope: an operator scope, `node` (node role only) or `dynamic` (decided from params, src/gateway/method-scopes.ts)");
for (const [name, , scope] of [...specs].sort((a, b) => (a[0] < b[0] ? -1 : 1))) {
  console.log(`${name}\t${scope}`);
}
