"""Headless Chromium for the browser tests: Debian's binary, never a downloaded one.

The flags keep it from reaching for the network (background updates, sync, QUIC), which a
machine without one answers with a flood of refused connections.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from playwright.sync_api import Browser, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


@contextlib.contextmanager
def launched() -> Iterator[Browser]:
    """A headless Chromium, closed at the end of the block."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=ARGS
        )
        try:
            yield browser
        finally:
            browser.close()
