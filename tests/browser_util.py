"""A real browser for the tests: headless Chromium screenshots, and where a colour shows in them.

tools/setup_env.sh installs Chromium (Debian package `chromium`) when it is
missing and it runs as root; a test skips only when no Chromium is there.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str:
    """The Chromium executable, or skip the test (tools/setup_env.sh installs it when it may)."""
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        pytest.skip("no Chromium here and tools/setup_env.sh could not install it (not root, or no apt-get)")
    return found


def screenshot(page: Path, png: Path, width: int, height: int) -> np.ndarray:
    """The page rendered headless at width x height, as RGB floats in [0, 1] (rows, columns, 3)."""
    import matplotlib.image as mpimg

    subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--no-first-run", f"--window-size={width},{height}", f"--screenshot={png}", page.as_uri()],
                   check=True, capture_output=True, timeout=180)
    pixels = mpimg.imread(png)
    assert pixels.shape[:2] == (height, width)
    return pixels[..., :3]


def colour_mask(pixels: np.ndarray, hex_colour: str, tolerance: float = 0.12) -> np.ndarray:
    """Where the screenshot shows `hex_colour` (each channel within `tolerance`: anti-aliasing blends edges)."""
    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return (np.abs(pixels - rgb) <= tolerance).all(axis=2)


def ink(pixels: np.ndarray) -> float:
    """The share of pixels that are not (near) white or the page background: 0 for a blank page."""
    return float((pixels.mean(axis=2) < 0.9).mean())


def drawn_label_sizes(page: Path, width: int) -> list[tuple[str, float]]:
    """Every text label of the page's network drawing with the font size Chromium draws it at (CSS px) when the
    page is `width` px wide: the label's font-size times the scale of its screen transform.

    The report allows no script (its Content-Security-Policy), so a harness page beside it loads it into a frame
    and measures from outside; `--dump-dom` prints the harness after its script wrote the sizes.
    """
    import html
    import json
    import re

    harness = page.parent / f".{page.stem}-labels.html"
    harness.write_text(f"""<!DOCTYPE html><html><body style="margin:0">
<iframe id="f" src="{page.name}" style="width:{width}px;height:2000px;border:0"></iframe>
<script>
document.getElementById('f').addEventListener('load', () => {{
  const out = [];
  for (const t of document.getElementById('f').contentDocument.querySelectorAll('svg.network text')) {{
    const m = t.getScreenCTM();
    out.push([t.textContent, parseFloat(t.getAttribute('font-size')) * Math.hypot(m.a, m.b)]);
  }}
  const pre = document.createElement('pre');
  pre.id = 'sizes';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}});
</script></body></html>""", encoding="utf-8")
    try:
        done = subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                               f"--window-size={width + 20},2000", "--virtual-time-budget=10000", "--dump-dom",
                               harness.as_uri()], check=True, capture_output=True, text=True, timeout=180)
    finally:
        harness.unlink()
    found = re.search(r'<pre id="sizes">(.*?)</pre>', done.stdout, re.S)
    assert found, "the harness wrote no sizes (the frame did not load?)"
    return [(text, size) for text, size in json.loads(html.unescape(found.group(1)))]
