"""Where the page tests find a browser: Debian's chromium, and the flags it runs with here."""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")


CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
