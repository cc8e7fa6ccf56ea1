"""Pages as a user sees them: Debian's Chromium, headless, runs the UI's JavaScript and hands back the rendered text.

    text = page_text("http://127.0.0.1:5000/#/experiments/1/runs")    # what a page shows
    with Page(tmp_path) as page: ...                                     # what a user clicks through

Tests that use it skip without Chromium (`make browser` installs it: `.ci/run` does).
"""

from __future__ import annotations

import fcntl
import html
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


class Page:
    """One tab of a fresh headless Chromium (empty profile: no saved UI settings), driven over the DevTools protocol
    on a pipe (`--remote-debugging-pipe`: fd 3 in, fd 4 out), for tests that click through a page.

        with Page(tmp_path) as page:
            page.goto(url)
            page.click_text("wsidino")
            page.wait_for(lambda: "Runs" in page.text())
    """

    def __init__(self, profile: Path) -> None:
        assert CHROMIUM is not None
        to_browser, self._out = os.pipe()
        self._in, from_browser = os.pipe()

        def pipes_at_3_and_4() -> None:  # where Chromium looks for them; high copies first, so no clash
            a, b = fcntl.fcntl(to_browser, fcntl.F_DUPFD, 10), fcntl.fcntl(from_browser, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,900", "--no-first-run"]
        self._proc = subprocess.Popen(
            [CHROMIUM, *args, f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=pipes_at_3_and_4,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._next, self._buffer, self._session = 0, b"", None
        target = self._call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self._call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.kill()
        self._proc.wait()
        os.close(self._in)
        os.close(self._out)

    def _call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if self._session:
            message["sessionId"] = self._session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._in, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the DevTools pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next:  # events in between are not needed
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        return self._call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def goto(self, url: str) -> None:
        self._call("Page.navigate", url=url)

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def url(self) -> str:
        return self.evaluate("location.href") or ""

    def wait_for(self, condition: Callable[[], Any], timeout: float = 60.0, what: str = "the page") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what} did not appear within {timeout:.0f} s; the page shows: {self.text()[:1500]}"
                )
            time.sleep(0.25)

    def click_text(self, text: str, selector: str = "a", timeout: float = 60.0) -> None:
        """Click, with the mouse, the first visible `selector` element whose text is `text`."""
        find = (
            f"(() => {{ const el = [...document.querySelectorAll({json.dumps(selector)})].find("
            f"e => e.innerText.trim() === {json.dumps(text)} && e.getBoundingClientRect().width > 0);"
            " if (!el) return null; el.scrollIntoView({block: 'center'}); const r = el.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        self.wait_for(lambda: self.evaluate(find), timeout, f"a {selector} reading {text!r}")
        x, y = self.evaluate(find)
        for kind in ("mousePressed", "mouseReleased"):
            self._call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
