"""Screenshot /dashboard under load: `python scripts/dashboard_screenshot.py [--out PNG]`.

Serves the embedded SmolLM2-135M on a free loopback port (a small KV cache, so the grid is
readable), sends a mix of traffic (chat requests with a shared system prompt, an n=4 request,
long generations that fill the cache), opens the page in headless chromium with the contiguous
view beside it, hovers the n=4 request and saves the picture (default docs/dashboard.png, the
one the README shows). Needs chromium and chromedriver (`make install` puts them there).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import httpx

# chromium shares the cores: a torch team of one thread does not spin against it (see
# engine/engine_thread.py on OpenMP teams)
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.browser import headless_chrome, wait_for  # noqa: E402
from tests.server.conftest import start_server, stop_server  # noqa: E402

SYSTEM = ("You are a helpful assistant for a team that runs language models on CPUs. "
          "Answer briefly and precisely. ") * 3
QUESTIONS = ["What is a KV cache?", "Why does paging help?", "What is prefix caching?",
             "Explain copy-on-write.", "What is continuous batching?", "Why swap to host?",
             "What limits batch size?", "How does beam search share blocks?"]


def chat(url: str, model: str, question: str, stop: threading.Event, **extra) -> None:
    while not stop.is_set():
        try:
            httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "max_tokens": 96, "temperature": 0.8,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": question}], **extra})
        except httpx.HTTPError:
            return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    p.add_argument("--settle", type=float, default=20.0, help="seconds of traffic before the shot")
    args = p.parse_args()
    from octavo.model.sources import resolve_model_dir

    server = start_server(resolve_model_dir(None), name="smollm2", num_kv_blocks=640,
                          block_size=16, max_num_seqs=12, max_model_len=2048,
                          preemption_mode="swap")
    stop = threading.Event()
    workers = [threading.Thread(target=chat, args=(server.url, server.model, q, stop))
               for q in QUESTIONS[:6]]
    workers.append(threading.Thread(target=chat, args=(server.url, server.model,
                                                       QUESTIONS[6], stop), kwargs={"n": 4}))
    try:
        with headless_chrome() as driver:
            driver.set_window_size(1600, 1050)
            driver.get(f"{server.url}/dashboard")
            wait_for(driver, "return +(document.body.dataset.snapshots || 0) >= 1", 60)
            for w in workers:
                w.start()
            time.sleep(args.settle)
            from selenium.webdriver.common.action_chains import ActionChains
            from selenium.webdriver.common.by import By

            driver.find_element(By.CSS_SELECTOR, "input[name=view][value=request]").click()
            time.sleep(2.0)
            row = wait_for(driver, """
                const r = snap.requests.find((x) => x.n === 4 && x.status === 'running');
                return r && document.querySelector(
                    `#requests tr[data-request-id="${CSS.escape(r.request_id)}"]`);
            """, 60, "a running n=4 request")
            ActionChains(driver).move_to_element(row).perform()
            time.sleep(0.6)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.out)
            print(f"wrote {args.out}")
    finally:
        stop.set()
        stop_server(server)
        for w in workers:
            if w.is_alive():
                w.join(timeout=30)


if __name__ == "__main__":
    main()
