"""The contiguous baseline: KV allocation that reserves each sequence's buffer up front, behind
the same interface as the paged manager, for benchmarks and the page map's comparison."""
