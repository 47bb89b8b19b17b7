"""A real headless browser for the dashboard tests: Debian's chromium driven by Selenium.

`make install` installs chromium and chromium-driver where it can (apt, as root); where they
are missing, `headless_chrome()` skips the test and says why. Selenium is given both paths, so
Selenium Manager never looks for a driver online.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# Flags as the machine's own probe starts chromium: no sandbox (root), no GPU, and nothing
# that phones home (this machine's network refuses it, many times a second).
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1400,1000")


def browser_paths() -> tuple[str, str] | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@contextmanager
def headless_chrome() -> Iterator[Any]:
    paths = browser_paths()
    if paths is None:
        pytest.skip("no chromium + chromedriver on this machine (make install puts Debian's "
                    "chromium and chromium-driver there with apt; it could not here)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="octavo-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(service=Service(executable_path=paths[1]), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def wait_for(driver: Any, script: str, timeout: float = 20.0, what: str = "") -> Any:
    """Poll `script` (JS returning a value) until it is truthy; its value."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: d.execute_script(script), message=f"timed out waiting for {what or script}")
