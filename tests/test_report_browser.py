"""report.html as a person sees it: the top of the page in headless Chromium (issue 25 item 5).

A 2-rank run whose rank 0 fails at step 1 and is restarted (two attempts on one loss curve) writes its report;
Playwright drives Debian's ``/usr/bin/chromium`` (never a downloaded browser, as tests/test_browser.py) to open the
file offline, waits until the page has decompressed plotly.js and drawn every figure, and screenshots the top of the
page: the artifact is ``report-top.png`` in pytest's tmp dir (the path is printed). The picture is checked in the
browser itself (a canvas reads its pixels; no imaging package is needed): not blank, the title's text and its
underline rendered where the title is, the loss line drawn inside the loss plot. Skips, saying why, only where no
browser can be had.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from workbench.run import run_training
from workbench.training.config import RunConfig

# A run with a restart and a browser (~80 s on 2 busy cores): the extended lane, beside tests/test_browser.py.
pytestmark = [pytest.mark.browser, pytest.mark.extended, pytest.mark.timeout(300)]

CHROMIUM = Path("/usr/bin/chromium")
# The network here refuses Chromium's background connections; --no-sandbox: CI runs as root (tests/test_browser.py)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
VIEWPORT = {"width": 1280, "height": 1000}
DRAW_S = 60.0  # decompressing 1.5 MB and drawing five figures on 2 busy cores takes a few seconds
ACCENT = (0x63, 0x6E, 0xFA)  # the title's underline and the loss line: the report's first colour

# Pixel statistics of a region of a PNG, computed by the browser on a canvas.
_PIXELS_JS = """async ([png, box]) => {
  const img = new Image();
  img.src = "data:image/png;base64," + png;
  await img.decode();
  const canvas = document.createElement("canvas");
  canvas.width = img.width; canvas.height = img.height;
  const ctx = canvas.getContext("2d");
  ctx.drawImage(img, 0, 0);
  const [x, y, w, h] = box.map(Math.round);
  const d = ctx.getImageData(x, y, w, h).data;
  let dark = 0, nonWhite = 0, accent = 0;
  for (let i = 0; i < d.length; i += 4) {
    const [r, g, b] = [d[i], d[i + 1], d[i + 2]];
    if (r + g + b < 200) dark++;
    if (r < 245 || g < 245 || b < 245) nonWhite++;
    if (Math.abs(r - ACCENT_R) < 30 && Math.abs(g - ACCENT_G) < 30 && Math.abs(b - ACCENT_B) < 30) accent++;
  }
  return {pixels: d.length / 4, dark, nonWhite, accent, width: img.width, height: img.height};
}""".replace("ACCENT_R", str(ACCENT[0])).replace("ACCENT_G", str(ACCENT[1])).replace("ACCENT_B", str(ACCENT[2]))


def _sync_playwright():
    if not CHROMIUM.exists():
        pytest.skip(f"no browser: {CHROMIUM} is missing (Debian: apt-get install -y --no-install-recommends chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.skip(f"no browser driver: playwright is not importable ({exc}); pip install -e '.[dev]'")
    return sync_playwright


def test_the_top_of_the_report_renders_in_chromium(tmp_path: Path) -> None:
    sync_playwright = _sync_playwright()
    cfg = RunConfig(nproc=2, steps=4, batch_size=8, seq_len=32, ckpt_dir=str(tmp_path / "ckpt"), ckpt_every=1,
                    max_restarts=1, inject_fault="raise:rank=0:step=2")
    summary = run_training(cfg, out=tmp_path / "run", progress=False)
    assert [a["cause"] for a in summary["attempts"]] == ["start", "restart"]
    shot = tmp_path / "report-top.png"
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((tmp_path / "run" / "report.html").as_uri())
            page.wait_for_function("document.body.dataset.figures !== undefined", timeout=DRAW_S * 1000)
            assert page.evaluate("document.body.dataset.figures") == "drawn", errors
            drawn = page.evaluate("document.querySelectorAll('.wb-figure.js-plotly-plot').length")
            assert drawn == page.evaluate("document.querySelectorAll('script[data-wb-figure]').length") >= 4
            title = page.locator("h1").bounding_box()
            loss = page.locator(".wb-figure").first.bounding_box()
            assert page.title().startswith("workbench report: ")
            png = page.screenshot(path=str(shot))  # the viewport: the top of the page, as a person first sees it
            print(f"\nreport screenshot: {shot}")
            whole = page.evaluate(_PIXELS_JS, [base64.b64encode(png).decode(), [0, 0, *VIEWPORT.values()]])
            heading = page.evaluate(_PIXELS_JS, [base64.b64encode(png).decode(),
                                                 [title["x"], title["y"], title["width"], title["height"]]])
            assert loss["y"] + loss["height"] <= VIEWPORT["height"], "the loss curve is below the first screen"
            plot = page.evaluate(_PIXELS_JS, [base64.b64encode(png).decode(),
                                              [loss["x"], loss["y"], loss["width"], loss["height"]]])
        finally:
            browser.close()
    assert (whole["width"], whole["height"]) == tuple(VIEWPORT.values())
    assert whole["nonWhite"] > 0.03 * whole["pixels"], whole  # not a blank page
    assert heading["dark"] > 0.02 * heading["pixels"], heading  # the title's letters
    assert heading["accent"] > 0.5 * title["width"], heading  # its underline, across the width
    assert plot["accent"] > 200, plot  # the loss line and its markers, drawn by plotly
    assert not errors, errors
