#!/usr/bin/env bash
# The GPU check: octavo's GPU path on a machine with an NVIDIA GPU, in one command, in under 8
# minutes, ending with one summary table (also OUT_DIR/summary.md; each step's log beside it).
#
#   bash scripts/gpu_check.sh [--dry-run] [OUT_DIR]     (OUT_DIR: gpu_check_out)
#   bash scripts/gpu_check.sh --fetch-wheels [DIR]      (DIR: .whl; where PyPI is reachable)
#
# --dry-run runs on any machine: it prints every step with its command and time limit, checks
# that each Python package the steps import is importable by $PYTHON or has a wheel in the
# wheel folder, and collects the CUDA tests as the GPU run would (unless
# OCTAVO_GPU_CHECK_COLLECT=0); it exits 1 if something is missing. The GPU run:
#
#   machine   nvidia-smi and a CUDA build of torch in $PYTHON (default python3). Nothing here
#             ever installs torch, or Triton (it must match torch: a machine without it skips
#             the steps that need it and says so).
#   packages  what the steps import beyond torch; a missing one is installed from the wheel
#             folder ($OCTAVO_WHEELS, default .whl in the repo root: --fetch-wheels fills it,
#             pure wheels for Python 3.12 on manylinux x86_64, no dependencies) into a folder of
#             its own, never over the machine's packages. A step whose packages are still
#             missing is skipped, naming them.
#   model     a random-weight SmolLM2-shaped model in bf16 for the benchmark
#             (tests/gpu/random_model.py; speed does not depend on the weights' values).
#   tests     OCTAVO_TEST_DEVICE=cuda: every Triton kernel against the torch backend on CUDA
#             tensors, the engine against HF transformers in fp32 up to recorded near-ties
#             (tests/near_ties.py) with real CUDA graphs, eagerly and under preemption, MoE
#             graphs, the graphs' memory against the KV sizing's estimate.
#   bench     octavo bench gpu --quick: paged decode attention against contiguous SDPA (batch 64
#             x 1k context among others) and offline throughput on `mixed`.
#   summary   one table: the machine, each step's result and time, the tests, the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
read -ra PY <<< "${PYTHON:-python3}"
WHEELS=${OCTAVO_WHEELS:-$ROOT/.whl}

# every package a step imports besides torch and triton (module and pip name alike)
PACKAGES=(transformers tokenizers safetensors numpy pytest tqdm matplotlib)
TEST_FILES=(tests/model/kernels/test_triton_kernels.py tests/model/kernels/test_triton_engine.py
            tests/model/worker/test_cuda_graphs.py
            tests/model/worker/test_cache_sizing.py::test_profile_run_on_triton_kernels
            tests/gpu)

case "${1:-}" in
  --fetch-wheels)
    dest=${2:-$ROOT/.whl}
    mkdir -p "$dest"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$dest" "${PACKAGES[@]}" || exit 1
    du -sh "$dest"
    size=$(du -sm "$dest" | cut -f1)
    ((size < 60)) || { echo "gpu_check: $dest is ${size} MiB: over what travels (64 MiB)" >&2
                       exit 1; }
    exit 0;;
  --dry-run) DRY=1; shift;;
  *) DRY=0;;
esac
OUT=${1:-gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)
: > "$OUT/steps.tsv"

# the wheel in the wheel folder for a pip name (dashes and underscores alike), if any
wheel_for() {
  local norm=${1//-/_}
  compgen -G "$WHEELS/${norm}-*.whl" | head -1
}

# which of the given modules $PYTHON cannot import
missing_of() {
  "${PY[@]}" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}

# -- packages --------------------------------------------------------------------------------
echo "== packages for ${PY[*]}"
UNRESOLVED=()
if ! "${PY[@]}" -c 'import torch' 2>/dev/null; then
  echo "  torch: missing (a CUDA build is needed; nothing here installs torch)"
  ((DRY)) || exit 1
  UNRESOLVED+=(torch)
fi
read -ra ABSENT <<< "$(missing_of triton "${PACKAGES[@]}")"
for mod in "${ABSENT[@]}"; do
  whl=$(wheel_for "$mod")
  if [[ $mod == triton ]]; then
    echo "  triton: missing (it must match torch: the steps that need it are skipped)"
    UNRESOLVED+=(triton)
  elif [[ -n $whl ]]; then
    echo "  $mod: missing, installs from $whl"
  else
    echo "  $mod: missing, and no wheel for it in $WHEELS"
    UNRESOLVED+=("$mod")
  fi
done
"${PY[@]}" - triton "${PACKAGES[@]}" <<'EOF'
import importlib.metadata as md, importlib.util, sys
for m in sys.argv[1:]:
    if importlib.util.find_spec(m) is not None:
        try:
            v = md.version(m)
        except md.PackageNotFoundError:
            v = "?"
        print(f"  {m}: {v}")
EOF

# the tests in 8 processes where pytest-xdist is installed: Triton compiles each kernel variant
# of the grid once per process, and compiling is most of their time on a fresh machine
XDIST=$("${PY[@]}" -c 'import importlib.util as u; print("-n 8" if u.find_spec("xdist") else "")')
# step name | time limit (s) | modules it needs | command. The limits add up to 440 s: with the
# machine and package checks and the summary, the check ends within 8 minutes.
STEP_MODEL=(model 90 "transformers tokenizers safetensors"
  "${PY[*]} -m tests.gpu.random_model @OUT@/model --shape smollm2")
STEP_TESTS=(tests 220 "triton transformers tokenizers safetensors numpy pytest"
  "OCTAVO_TEST_DEVICE=cuda ${PY[*]} -m pytest -q -p no:cacheprovider -rs ${XDIST:+$XDIST }--junitxml=@OUT@/tests.xml ${TEST_FILES[*]}")
STEP_BENCH=(bench 130 "triton transformers tokenizers safetensors numpy tqdm matplotlib"
  "${PY[*]} -m octavo.cli bench gpu --quick --model @OUT@/model --dtype bfloat16 --out @OUT@")
STEPS=(STEP_MODEL STEP_TESTS STEP_BENCH)
if ((DRY)); then
  echo "== dry run: nothing runs; on a GPU the check would run, in order:"
  echo "  machine: nvidia-smi -L; ${PY[*]} -c 'import torch; torch.cuda.is_available()'"
  if ((${#ABSENT[@]})); then
    echo "  packages: ${PY[*]} -m pip install --no-index --no-deps --target $OUT/site <the wheels above>"
  else
    echo "  packages: nothing to install"
  fi
  for s in "${STEPS[@]}"; do
    declare -n step=$s
    echo "  ${step[0]} (limit ${step[1]} s; needs ${step[2]}): ${step[3]//@OUT@/$OUT}"
  done
  [[ -z $XDIST ]] && echo "  (pytest-xdist is not installed here: the tests would run in one" \
    "process, slower on a fresh GPU machine)"
  echo "  summary: $OUT/summary.md"
  echo "== the tests the GPU run collects (OCTAVO_TEST_DEVICE=cuda)"
  if ((${#UNRESOLVED[@]})); then
    echo "  (not collected: packages are missing)"
  elif [[ ${OCTAVO_GPU_CHECK_COLLECT:-1} == 0 ]]; then
    echo "  (not collected: OCTAVO_GPU_CHECK_COLLECT=0)"
  else
    OCTAVO_TEST_DEVICE=cuda "${PY[@]}" -m pytest --collect-only -q -p no:cacheprovider \
      "${TEST_FILES[@]}" > "$OUT/collect.log" 2>&1
    rc=$?
    grep -E '^tests/.*: [0-9]+$' "$OUT/collect.log" | sed 's/^/  /'
    echo "  $(awk -F': ' '/^tests\/.*: [0-9]+$/ {n += $2} END {print n + 0}' \
      "$OUT/collect.log") tests"
    ((rc == 0)) || { echo "gpu_check: collecting the tests failed ($OUT/collect.log)" >&2
                     UNRESOLVED+=(collection); }
  fi
  if ((${#UNRESOLVED[@]})); then
    echo "gpu_check: missing: ${UNRESOLVED[*]}" >&2
    exit 1
  fi
  echo "== dry run: everything the check needs is here"
  exit 0
fi

# -- the machine -----------------------------------------------------------------------------
nvidia-smi -L || { echo "gpu_check: nvidia-smi found no NVIDIA GPU" >&2; exit 1; }
"${PY[@]}" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' || {
  echo "gpu_check: ${PY[*]} has no CUDA build of torch, or sees no GPU" >&2; exit 1; }

# -- packages: the missing ones from wheels, into a folder of their own ------------------------
install=()
for mod in "${ABSENT[@]}"; do
  whl=$(wheel_for "$mod")
  [[ -n $whl && $mod != triton ]] && install+=("$whl")
done
if ((${#install[@]})); then
  "${PY[@]}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$OUT/site" "${install[@]}" && export PYTHONPATH="$PYTHONPATH:$OUT/site"
  read -ra UNRESOLVED <<< "$(missing_of "${ABSENT[@]}")"
fi

# -- the steps -------------------------------------------------------------------------------
for s in "${STEPS[@]}"; do
  declare -n step=$s
  name=${step[0]} limit=${step[1]}
  lacking=()
  for mod in ${step[2]}; do
    [[ " ${UNRESOLVED[*]} " == *" $mod "* ]] && lacking+=("$mod")
  done
  if [[ $name == bench && ! -f $OUT/model/config.json ]]; then
    lacking+=("the model step's model")
  fi
  if ((${#lacking[@]})); then
    echo "== $name: skipped (missing: ${lacking[*]})"
    printf '%s\tskipped\t0\tmissing: %s\n' "$name" "${lacking[*]}" >> "$OUT/steps.tsv"
    continue
  fi
  cmd=${step[3]//@OUT@/$OUT}
  echo "== $name (limit $limit s): $cmd"
  t0=$(date +%s)
  # SIGINT first: pytest then writes the results it has (junitxml) before it exits
  timeout -s INT --kill-after=20 "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -25 "$OUT/$name.log"
  status=$([[ $rc == 0 ]] && echo ok || { [[ $rc == 124 || $rc == 137 ]] \
    && echo "timed out" || echo "failed (exit $rc)"; })
  printf '%s\t%s\t%s\t\n' "$name" "$status" "$(( $(date +%s) - t0 ))" >> "$OUT/steps.tsv"
done

# -- one summary table -----------------------------------------------------------------------
"${PY[@]}" - "$OUT" "$(( $(date +%s) - START ))" "${UNRESOLVED[*]}" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, secs, missing = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = []
try:
    import torch
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "missing"
    rows.append(("GPU", f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, "
                 f"CUDA {torch.version.cuda}, triton {tv}"))
except Exception as e:  # noqa: BLE001
    rows.append(("GPU", f"unknown ({e})"))
rows.append(("packages missing", missing or "none"))
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, took, why = (line.split("\t") + [""] * 4)[:4]
    rows.append((f"step {name}", f"{status}, {took} s" + (f" ({why})" if why else "")))
try:
    root = ET.parse(out / "tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root[0]
    n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    failed = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    rows.append(("CUDA tests (kernels, engine vs HF, graphs)",
                 f"{n - f - e - s} passed, {f + e} failed, {s} skipped"
                 + (f"; failed: {', '.join(failed[:5])}" + (" ..." if len(failed) > 5 else "")
                    if failed else "")))
except Exception as e:  # noqa: BLE001
    rows.append(("CUDA tests", f"no result ({e})"))
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
    rows.append(("benchmark", f"no result ({e})"))
rows.append(("wall time", f"{secs} s"))
width = max(len(k) for k, _ in rows)
lines = ["| check | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
EOF
grep -qv $'\tok\t' "$OUT/steps.tsv" && exit 1
exit 0
