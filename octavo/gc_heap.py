"""Start-up's objects out of the garbage collector's reach, as vLLM does after start-up.

Everything alive once a model is loaded (its modules, the tokenizer, every imported package:
about 370k objects) sits in the collector's oldest generation, and each full collection walks
all of it: 160-170 ms on an Intel Xeon, stalling the engine step it lands in (BENCHMARKS.md
section 8). `freeze_gc_heap()` moves them to the permanent generation, which collections skip.
Frozen objects are still freed by reference counting, so nothing the engine holds may sit in a
reference cycle (tests/engine/test_gc_freeze.py). `gc.unfreeze()` undoes it: the engine's
shutdown() calls it, and so does the interpreter's exit (extensions that count their objects at
exit, as Triton's do, would report the frozen ones as leaked).
"""

from __future__ import annotations

import atexit
import gc

_unfreeze_at_exit = False


def freeze_gc_heap() -> None:
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    gc.collect()
    gc.freeze()
