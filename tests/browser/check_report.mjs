// Open a driftscope HTML report in headless Chromium (playwright-core) and print what a person would see, as JSON.
//
//   node check_report.mjs REPORT.html SCREENSHOT.png [PROFILE_DIR]
//
// Used by tests/comparator/reports/test_html_browser.py, which asserts on the JSON. Every request that is not file: or data:
// is blocked and recorded: the report must fetch nothing.
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { pathToFileURL } from "node:url";
import { chromium } from "playwright-core";

const [htmlPath, screenshot, profileArg] = process.argv.slice(2);
const profile = profileArg || mkdtempSync(join(tmpdir(), "driftscope-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  chromiumSandbox: false,
  viewport: { width: 1200, height: 900 },
  deviceScaleFactor: 1,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const result = { consoleErrors: [], fetched: [] };
try {
  const page = context.pages()[0] || (await context.newPage());
  page.on("console", (m) => { if (m.type() === "error") result.consoleErrors.push(m.text()); });
  page.on("pageerror", (e) => result.consoleErrors.push(String(e)));
  await context.route("**/*", (route) => {
    const url = route.request().url();
    if (url.startsWith("file:") || url.startsWith("data:")) return route.continue();
    result.fetched.push(url);
    return route.abort();
  });
  await page.goto(pathToFileURL(resolve(htmlPath)).href, { waitUntil: "load" });

  result.title = await page.title();
  result.charts = {};
  for (const id of ["layer-chart", "amplification-chart", "heatmap-chart", "logprob-chart"]) {
    result.charts[id] = await page.evaluate((id) => {
      const svg = document.querySelector(`#${id} svg`);
      if (!svg) return null;
      const box = svg.getBoundingClientRect();
      return { width: box.width, height: box.height, shapes: svg.querySelectorAll("path, image, rect").length,
               images: svg.querySelectorAll("image").length };
    }, id);
  }
  const names = () => page.$$eval("#tensor-table tbody tr", (rows) => rows.map((r) => r.cells[0].textContent));
  result.tableNames = await names();
  // sort by rel_diff: ascending on the first click, descending on the second
  const column = await page.$$eval("#tensor-table thead th", (ths) => ths.findIndex((th) => th.textContent === "rel_diff"));
  const values = () => page.$$eval("#tensor-table tbody tr", (rows, i) => rows.map((r) => Number(r.cells[i].dataset.v)), column);
  const header = page.locator("#tensor-table thead th").nth(column);
  await header.click();
  result.sortedAscending = await values();
  result.ariaSort = await header.getAttribute("aria-sort");
  await header.click();
  result.sortedDescending = await values();
  await page.evaluate(() => window.scrollTo(0, 0));
  await page.screenshot({ path: screenshot, fullPage: false });
} finally {
  await context.close();
}
console.log(JSON.stringify(result));
