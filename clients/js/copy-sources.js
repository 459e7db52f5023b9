// Run by `npm pack` (and `npm publish`) before the tarball is made: copies the module from
// broker/static/js/, its one source, where the broker serves it to the demo page, into lib/.
// A package cannot point outside its own folder, so the tarball carries this copy; lib/ is not
// committed.
import { copyFileSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const source = join(here, "..", "..", "broker", "static", "js");
const target = join(here, "lib");

rmSync(target, { recursive: true, force: true });
mkdirSync(target);
const copied = readdirSync(source).filter((name) => name.endsWith(".js") || name.endsWith(".d.ts"));
if (!copied.includes("index.js") || !copied.includes("index.d.ts")) {
  throw new Error(`no index.js and index.d.ts in ${source}`);
}
for (const name of copied) copyFileSync(join(source, name), join(target, name));
console.error(`copied ${copied.length} files from broker/static/js into lib/`);
