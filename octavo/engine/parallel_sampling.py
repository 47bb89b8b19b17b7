"""Parallel sampling (n > 1): one prompt, n samples sharing its KV blocks.

A request runs one sequence until its prompt is computed. In the step whose chunk completes the
prompt, `fan_out` forks the other n - 1 samples from it: they share every block (copy-on-write
copies only a partial last block, when one of them first writes into it), and all n sample
their first token from the logits of that one chunk, each with its own seeded stream (the
runner derives it from the sample's index).
"""

from __future__ import annotations

from octavo.engine.request import Request, Sequence
from octavo.paging.allocator import KVAllocator


def needs_fan_out(request: Request) -> bool:
    return request.beam is None and len(request.seqs) < request.params.n


def fan_out(request: Request, kv: KVAllocator) -> list[Sequence]:
    """Fork samples 1 .. n-1 from the request's only sequence; returns them."""
    parent = request.seqs[0]
    children = []
    for index in range(1, request.params.n):
        child = parent.fork(index=index)
        kv.fork(parent.seq_id, child)
        children.append(child)
    request.seqs.extend(children)
    return children
