"""Shared fixtures: the embedded model's tokenizer, loaded once per session (it takes ~2 s)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    from octavo.model.loader import ensure_default_model

    return transformers.AutoTokenizer.from_pretrained(str(ensure_default_model()))
