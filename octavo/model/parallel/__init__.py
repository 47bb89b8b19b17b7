"""Tensor parallelism: how weights are sharded, and the shared-memory collectives."""
