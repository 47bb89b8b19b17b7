"""/dashboard in a real headless browser (chromium via Selenium) while requests run: one cell
per block, shared blocks during an n=4 request, cached blocks after a finished prefix request,
counts that match stats(), the hover and the contiguous toggle. Skips, saying why, where no
chromium can be installed (tests/server/browser.py)."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.conftest import build_tiny_llama
from tests.server.browser import headless_chrome, wait_for
from tests.server.conftest import API_KEY, start_server, stop_server

# 4 samples of 3500 tokens reserve 4 x 221 blocks up front: more than 800, so the contiguous
# view has one wait, while the paged cache holds what they have generated (the test stops
# them long before they would fill it)
NUM_BLOCKS = 800

# one evaluation in the page (JS runs to completion, so it sees one snapshot's DOM)
GRID = """
const g = document.getElementById("grid");
const cells = [...g.querySelectorAll("[data-block-id]")];
const by = {};
for (const c of cells) by[c.dataset.state] = (by[c.dataset.state] || 0) + 1;
return {cells: cells.length, by, used: +g.dataset.kvBlocksUsed,
        cached: +g.dataset.kvBlocksCachedFree, total: +g.dataset.kvBlocksTotal,
        ids: cells.map((c) => +c.dataset.blockId),
        refs: cells.filter((c) => c.dataset.state === "shared").map((c) => +c.dataset.ref),
        snapshots: +(document.body.dataset.snapshots || 0)};
"""


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory):
    """The tiny Llama with room for long generations, so a request stays running while the
    page is read."""
    return build_tiny_llama(tmp_path_factory.mktemp("long-llama"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def page_server(long_llama_dir):
    s = start_server(long_llama_dir, num_kv_blocks=NUM_BLOCKS, block_size=16, max_num_seqs=8,
                     max_model_len=4096, preemption_mode="swap")
    yield s
    stop_server(s)


class Streaming:
    """A streaming completion that runs until `close()`: the client leaves, the server aborts."""

    def __init__(self, server, **body) -> None:
        self.server, self.body = server, body
        self.started, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        assert self.started.wait(30), "the streaming request did not start"

    def _run(self) -> None:
        with httpx.stream("POST", f"{self.server.v1}/completions", timeout=60, json={
                "model": self.server.model, "stream": True, "ignore_eos": True,
                **self.body}) as r:
            for _ in r.iter_lines():
                self.started.set()
                if self.stop.is_set():
                    return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def counts_agree(grid: dict) -> bool:
    by = grid["by"]
    return (by.get("used", 0) + by.get("shared", 0) == grid["used"]
            and by.get("cached", 0) == grid["cached"])


def test_the_page_draws_sharing_caching_and_the_requests(page_server, tmp_path):
    url = page_server.url
    with headless_chrome() as driver:
        driver.get(f"{url}/dashboard?hz=10")
        grid = wait_for(driver, f"const r = (() => {{{GRID}}})(); return r.snapshots && r", 30,
                        "the first snapshot")
        assert grid["cells"] == grid["total"] == NUM_BLOCKS
        assert grid["ids"] == list(range(NUM_BLOCKS))
        assert grid["by"] == {"free": NUM_BLOCKS} and counts_agree(grid)
        host = driver.execute_script(
            "return document.querySelectorAll('#host-grid [data-block-id]').length")
        assert host == NUM_BLOCKS  # preemption_mode=swap: as many host blocks as device ones

        # an n=4 request: its prompt blocks are shared, four references each
        n4 = Streaming(page_server, prompt="shared prompt " * 6, n=4, max_tokens=3500,
                       temperature=1.0, seed=1)
        try:
            grid = wait_for(driver, f"const r = (() => {{{GRID}}})(); "
                            "return r.by.shared && r.by.used && r", 30, "shared blocks")
            assert counts_agree(grid)
            assert set(grid["refs"]) == {4}
            # hovering its row outlines exactly its block table's cells
            from selenium.webdriver.common.action_chains import ActionChains
            from selenium.webdriver.common.by import By

            row = wait_for(driver, "return document.querySelector('#requests tr[data-request-id]')",
                           10, "the request's row")
            ActionChains(driver).move_to_element(row).perform()
            hover = wait_for(driver, """
                const r = hoverData;  // what the page fetched for the hovered row
                if (!r) return null;
                const held = new Set(r.seqs.flatMap((q) => q.block_tables.flat()));
                const hl = [...document.querySelectorAll('#grid .hl')]
                    .map((c) => +c.dataset.blockId);
                const num = (a, b) => a - b;
                return hl.length && {held: [...held].sort(num), hl: hl.sort(num),
                                     text: document.getElementById('detail').textContent,
                                     id: r.request_id, n: r.n};
            """, 10, "the hover highlight")
            assert hover["hl"] == hover["held"] and hover["n"] == 4
            assert hover["id"] in hover["text"] and "prompt" in hover["text"]
            assert "0→" in hover["text"]  # the logical -> physical mapping
            ActionChains(driver).move_to_element(driver.find_element(By.TAG_NAME, "h1")).perform()

            # the same traffic laid out contiguously, side by side
            driver.find_element(By.CSS_SELECTOR, "input[name=view][value=request]").click()
            contig = wait_for(driver, """
                const box = document.getElementById('contig');
                const cells = [...document.querySelectorAll('#contig-grid [data-block-id]')];
                return !box.hidden && cells.length && {
                    cells: cells.length, states: [...new Set(cells.map((c) => c.dataset.state))],
                    note: document.getElementById('contig-note').textContent};
            """, 10, "the contiguous view")
            assert contig["cells"] == NUM_BLOCKS
            assert set(contig["states"]) <= {"used", "reserved", "external", "free"}
            assert "reserved" in contig["states"]  # 3500 tokens each, reserved up front
            assert "1 more would have to wait" in contig["note"]
            shot = tmp_path / "dashboard.png"
            assert driver.save_screenshot(str(shot))
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        finally:
            n4.close()

        # aborted: its full blocks stay cached; then a prefix request hits them again
        grid = wait_for(driver, f"const r = (() => {{{GRID}}})(); "
                        "return !r.by.used && !r.by.shared && r.by.cached && r", 30,
                        "cached blocks after the request ended")
        assert counts_agree(grid)
        def hits() -> int:
            return httpx.get(f"{url}/v1/kv_map").json()["stats"]["prefix_cache_hit_tokens"]

        before = hits()
        for prompt in ("prefix " * 40, "prefix " * 40 + "again"):
            r = httpx.post(f"{page_server.v1}/completions", timeout=60, json={
                "model": page_server.model, "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200
        assert hits() - before >= 256  # the second found the first's 16 full blocks
        idle = page_server.wait_idle()
        grid = wait_for(driver, f"const r = (() => {{{GRID}}})(); "
                        f"return r.cached === {int(idle['octavo:kv_blocks_cached_free'])} && r",
                        10, "the idle snapshot")
        assert counts_agree(grid) and grid["by"].get("cached") == grid["cached"]
        hit = driver.execute_script("return document.getElementById('g-hit').textContent")
        assert hit.endswith("%") and float(hit[:-1]) > 0


def test_a_browser_logs_in_with_the_key_once(tiny_llama_dir):
    s = start_server(tiny_llama_dir, api_key=API_KEY, num_kv_blocks=32)
    try:
        with headless_chrome() as driver:
            driver.get(f"{s.url}/dashboard?api_key={API_KEY}")
            wait_for(driver, "return +(document.body.dataset.snapshots || 0) >= 2", 30,
                     "snapshots through the cookie")
            assert driver.execute_script("return location.pathname + location.search") == \
                "/dashboard"  # the key left the address bar
            cells = driver.execute_script(
                "return document.querySelectorAll('#grid [data-block-id]').length")
            assert cells == 32
    finally:
        stop_server(s)
