"""Pages as a user sees them: Debian's Chromium, headless, runs the UI's JavaScript and hands back the rendered text.

    text = page_text("http://127.0.0.1:5000/#/experiments/1/runs")

Tests that use it skip without Chromium (`make browser` installs it: `.ci/run` does).
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make browser)")


def page_text(url: str, budget_ms: int = 30_000) -> str:
    """The visible text of `url` once the page has run its scripts for `budget_ms` of virtual time."""
    assert CHROMIUM is not None
    command = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--window-size=1400,900",
        f"--virtual-time-budget={budget_ms}",
        "--dump-dom",
        url,
    ]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=180, check=True).stdout
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", dom, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text)))
