"""The architecture as a rule: every import in octavo/ (module level, inside functions, under
TYPE_CHECKING alike) goes along an allowed edge between layers, and no modules import each other
in a cycle.

    neutral (sampling_params, outputs, step_plan, config, engine_args, gc_heap, malloc_heap)
    paging <- engine <- llm <- {chat, server <- bench} <- cli;   model <- engine
    {server, paging, model} <- router <- {bench, cli}   (the data-parallel router)
    model <- cli   (`octavo pull` and `octavo models`: the installed models, no engine)
    paging and model know nothing of each other, of requests or of the layers above them.

Inside model/, the sub-packages are layers of their own (MODEL_ALLOWED):

    kernels <- layers <- quant <- models <- {parallel, loading} <- worker
    kernels <- sample <- spec <- worker;   layers <- spec
    (loading: model/loader.py, sources.py, dtype_policy.py)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "octavo"

NEUTRAL = {"octavo.sampling_params", "octavo.outputs", "octavo.step_plan", "octavo.config",
           "octavo.engine_args", "octavo.gc_heap", "octavo.malloc_heap", "octavo.envs",
           "octavo.options"}
# layer -> the layers it may import (its own included)
ALLOWED = {
    "neutral": {"neutral"},
    "paging": {"paging"},
    "model": {"model", "neutral"},
    "engine": {"engine", "paging", "model", "neutral"},
    "llm": {"llm", "engine", "neutral"},
    "chat": {"chat", "llm", "neutral"},
    "server": {"server", "llm", "engine", "neutral", "api"},
    "router": {"router", "server", "paging", "model", "neutral"},
    "bench": {"bench", "router", "server", "llm", "engine", "paging", "model", "neutral",
              "api"},
    "cli": {"cli", "chat", "server", "router", "bench", "llm", "model", "neutral", "api"},
    "api": {"api", "llm", "neutral"},  # octavo/__init__.py: the public names, lazily
}


# inside octavo/model: sub-package -> the sub-packages it may import (its own included)
MODEL_ALLOWED = {
    "kernels": {"kernels"},
    "layers": {"layers", "kernels"},
    "quant": {"quant", "layers", "kernels"},
    "models": {"models", "quant", "layers", "kernels"},
    "parallel": {"parallel", "models", "quant", "layers", "kernels"},
    "loading": {"loading", "parallel", "models", "quant", "layers", "kernels"},
    "sample": {"sample", "kernels"},
    "spec": {"spec", "sample", "layers", "kernels"},
    "worker": {"worker", "loading", "spec", "sample", "parallel", "models", "quant", "layers",
               "kernels"},
}


def model_layer_of(module: str) -> str | None:
    """The sub-package of octavo/model a module belongs to (None outside model/)."""
    parts = module.split(".")
    if parts[:2] != ["octavo", "model"]:
        return None
    if len(parts) > 2 and parts[2] in MODEL_ALLOWED:
        return parts[2]
    return "loading"


def model_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        src = model_layer_of(module)
        if src is None:
            continue
        for target in sorted(targets):
            dst = model_layer_of(target)
            if dst is not None and dst not in MODEL_ALLOWED[src]:
                bad.append(f"{module} ({src}) imports {target} ({dst})")
    return bad


def layer_of(module: str) -> str:
    if module in NEUTRAL:
        return "neutral"
    if module == "octavo":
        return "api"
    part = module.split(".")[1]
    return {"llm": "llm", "chat": "chat", "cli": "cli"}.get(part, part)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The octavo module an imported name lives in (a package counts as its __init__)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """Every octavo module `module` imports, wherever the import statement sits."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "octavo" and (target := resolve(name)) is not None:
                found.add(target)
    found.discard(module)
    return found


def external_imports_of(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    top: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            top.add(node.module.split(".")[0])
    return top


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        src = layer_of(module)
        for target in sorted(targets):
            dst = layer_of(target)
            if dst not in ALLOWED[src]:
                bad.append(f"{module} ({src}) imports {target} ({dst})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return {m: imports_of(m) for m in MODULES}


def test_every_import_follows_the_layer_rules(graph):
    assert violations(graph) == []


def test_model_sub_packages_import_only_downwards(graph):
    assert model_violations(graph) == []


def test_the_rules_catch_a_model_family_importing_the_worker(graph):
    """The sub-package check can fail: models/ importing worker/ (upwards) is reported."""
    bad = {**graph, "octavo.model.models.llama": graph["octavo.model.models.llama"]
           | {"octavo.model.worker.runner"}}
    assert model_violations(bad) == [
        "octavo.model.models.llama (models) imports octavo.model.worker.runner (worker)"]


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_the_rules_catch_a_model_module_importing_the_engine(graph):
    """The check itself can fail: an edge model -> engine is reported, and so is the cycle it
    closes with engine -> model."""
    bad = {**graph, "octavo.model.worker.runner": graph["octavo.model.worker.runner"]
           | {"octavo.engine.engine"}}
    assert violations(bad) == [
        "octavo.model.worker.runner (model) imports octavo.engine.engine (engine)"]
    assert any("octavo.model.worker.runner" in c and "octavo.engine.engine" in c
               for c in cycles(bad))


def test_the_engine_package_imports_no_torch():
    engine = [m for m in MODULES if m.startswith("octavo.engine.") or m == "octavo.engine"]
    assert engine
    assert [m for m in engine if "torch" in external_imports_of(m)] == []


def test_the_sampler_never_sees_sampling_params_or_requests(graph):
    for module in ("octavo.model.sample.sampler",):
        assert "octavo.sampling_params" not in graph[module]
        assert not any(t.startswith("octavo.engine") for t in graph[module])


def test_paging_and_neutral_modules_need_no_third_party_package():
    stdlib_only = [m for m in MODULES if layer_of(m) in ("paging", "neutral")]
    allowed = {"__future__", "argparse", "array", "atexit", "bisect", "collections", "ctypes",
               "concurrent", "contextlib", "copy", "dataclasses", "difflib", "enum", "errno",
               "gc", "hashlib", "os", "itertools", "json", "logging", "math", "operator",
               "pathlib", "queue", "re", "struct", "threading", "time", "types", "typing",
               "weakref", "zlib", "octavo"}
    heavy = {m: sorted(external_imports_of(m) - allowed) for m in stdlib_only}
    assert {m: v for m, v in heavy.items() if v} == {}
