"""The engine freezes the garbage collector's heap after start-up (octavo/gc_heap.py), so
that a full collection no longer walks the model, the tokenizer and every imported module; the
frozen engine must still be freed when it is dropped, and shutdown() unfreezes."""

from __future__ import annotations

import gc
import weakref

from octavo import LLM, SamplingParams
from tests.engine.conftest import tokens_prompt

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=32, max_model_len=128,
               dtype="float32")


def test_start_up_freezes_the_heap_and_steps_leave_little_to_collect(tiny_llama_dir):
    gc.unfreeze()
    llm = make_llm(tiny_llama_dir)
    try:
        frozen = gc.get_freeze_count()
        # the model's modules and the imported packages are all in the permanent generation
        assert frozen > 10_000
        assert any(m is llm.engine.runner.model for m in gc.get_objects()) is False
        outs = llm.generate([tokens_prompt([5, 6, 7, 8])] * 3, PARAMS)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
        # what the requests allocated is young: a full collection walks it, not the heap
        assert len(gc.get_objects()) < frozen / 10
    finally:
        llm.shutdown()


def test_shutdown_unfreezes(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    assert gc.get_freeze_count() > 0
    llm.shutdown()
    assert gc.get_freeze_count() == 0


def test_a_dropped_engine_is_freed_though_frozen(tiny_llama_dir):
    """Frozen objects are freed by reference counting only: a reference cycle through the
    engine would keep its weights and KV cache alive for good. None may exist."""
    gc.unfreeze()
    try:
        llm = make_llm(tiny_llama_dir)
        llm.generate([tokens_prompt([9, 10, 11])], PARAMS)
        llm.engine.kv_map()  # the page-map view holds the engine too
        engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.model)
        cache = weakref.ref(llm.engine.runner.kv_cache)
        assert gc.get_freeze_count() > 0
        del llm
        assert engine() is None and model() is None and cache() is None
    finally:
        gc.unfreeze()
