"""HF transformers' own reading of a model, as an HF directory: what the tests, the HF baseline
benchmark and the reference scripts load with `AutoModelForCausalLM.from_pretrained`.

For an HF directory that is the directory itself. For a model given as a GGUF file it is
transformers' GGUF loading (`from_pretrained(dir, gguf_file=...)`: every tensor dequantized to
fp32) saved once as ``$OCTAVO_CACHE/models/hf-reference/<name>`` beside the model's own config
and tokenizer files. octavo never loads from it; it is the yardstick the GGUF loader is measured
against (equal tensors, equal greedy tokens).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from octavo.envs import cache_dir
from octavo.model.sources import GGUF_RECORD, recorded_gguf, resolve_model_dir


def hf_reference_dir(model: str | os.PathLike[str] | None = None) -> Path:
    """An HF directory holding transformers' fp32 reading of `model` (see the module doc)."""
    model_dir = resolve_model_dir(model)
    gguf = recorded_gguf(model_dir)
    if gguf is None:
        return model_dir
    out = cache_dir() / "models" / "hf-reference" / model_dir.name
    if not (out / "model.safetensors").is_file():
        _convert(gguf, model_dir, out)
    return out


def _convert(gguf: Path, model_dir: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".reference-", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in model_dir.iterdir():
            if f.is_file() and f.name != GGUF_RECORD:
                shutil.copy(f, tmp / f.name)
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
