"""Shared layers: the decoder block's parts, linear layers, MoE, attention backends, KV cache
tensors."""
