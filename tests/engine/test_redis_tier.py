"""The remote KV tier on a Redis server this test starts (Debian's `redis-server`; skipped
where it is not installed): a second server loads the first one's blocks with the same greedy
tokens, a corrupt record is recomputed, and a Redis that goes away only costs the hits."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from tests.engine.test_kv_tier import generate, make_prompts, written

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")
if shutil.which("redis-server") is None:
    pytest.skip("no redis-server on this machine (Debian: apt-get install redis-server)",
                allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path), "--maxmemory", "64mb",
         "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield url, client, proc
    proc.terminate()
    proc.wait(10)


def test_servers_share_blocks_through_redis(redis_url, tmp_path) -> None:
    from octavo import LLM
    from tests.model.models.test_families import build

    url, client, proc = redis_url
    model = build(tmp_path / "m", "mistral-full")
    prompts = make_prompts(9, 100, (20, 45))

    def server() -> LLM:
        return LLM(model=str(model), block_size=16, num_kv_blocks=128, kv_offload_url=url)

    first = server()
    ref = generate(first, prompts)
    assert written(first) > 0
    assert client.dbsize() == first.stats()["tier_blocks_written"]

    second = server()
    assert generate(second, prompts) == ref
    assert second.stats()["tier_hit_tokens"] >= 96

    keys = sorted(client.keys("octavo:kv:*"))
    client.set(keys[0], client.get(keys[0])[:-1])  # a truncated record
    client.set(keys[1], b"junk")
    third = server()
    assert generate(third, prompts) == ref
    assert third.stats()["tier_read_failures"] >= 1

    proc.terminate()
    proc.wait(10)
    gone = server()  # the tier's server went away: every lookup misses, nothing breaks
    assert generate(gone, prompts) == ref
    assert gone.stats()["tier_hit_tokens"] == 0
