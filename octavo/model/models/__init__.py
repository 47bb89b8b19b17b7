"""One file per model family, and the registry that maps HF `model_type` to it."""
