"""What both browser tests share: one headless Chromium for the session."""

import os
import shutil

import pytest

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which(
    "chromium-browser")


@pytest.fixture(scope="session")
def browser():
    if not CHROMIUM:
        pytest.fail("no chromium on PATH: install it (Debian: apt-get install "
                    "chromium) or set CHROMIUM=/path/to/chrome")
    from playwright import sync_api

    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()
