"""Draw a bench page in headless Chromium and save it as PNG (docs/bench-page.png comes from here).

    python scripts/screenshot_page.py PAGE.html OUT.png

Chromium captures its window, so the window is made as tall as the page: the charts' own
heights (they are inline SVG) plus room for the text and the table.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def page_height(html: str) -> int:
    charts = sum(int(h) for h in re.findall(r'<svg[^>]* height="(\d+)"', html))
    rows = html.count("<tr")
    return charts + 28 * rows + 1400


def main() -> None:
    page, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:  # a throwaway profile: no state from earlier runs
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size=1200,{page_height(page.read_text())}",
                        f"--screenshot={out}", page.as_uri()],
                       check=True, capture_output=True, timeout=120)
    if not out.is_file():
        sys.exit("chromium wrote no screenshot")


if __name__ == "__main__":
    main()
