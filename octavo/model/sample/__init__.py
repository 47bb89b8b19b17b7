"""Sampling: the sampler, its per-step tensors, logits processors."""
