"""The runner's side of speculative decoding: draft models, self-drafting, acceptance."""
