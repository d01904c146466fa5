#!/usr/bin/env bash
# The prepared GPU check: six parts, each with its own timeout (benchmarks/gpu_budget.json, derived from
# each part's rehearsed FLOPs and bytes: 472 s together, under 9 minutes with the start), each writing
# its log under OUT as it ends, and OUT/summary.json over all of them with each part's JSON result (the
# results are written outside OUT first: a device run brings back at most 8 files, and six logs, six
# JSONs and the summary would be 13):
#
#   tests     the tests marked gpu: HF parity on cuda, cuda against cpu, flash attention, bf16 training,
#             deterministic resume, pinned loading, offload's copies (tests/gpu/test_cuda.py), the
#             block kernels on CUDA's fused ops, the merged log-sum-exp, no host sync in the fused cross
#             entropy, RMSNorm's saved bytes (tests/gpu/test_cuda_kernels.py), and the experts' grouped
#             GEMM against the loop in bf16, an MoE layer cuda = cpu, one host read per dispatch
#             (tests/gpu/test_cuda_moe.py), each fp8 recipe's float8 GEMMs against the CPU kernel's, the experts'
#             float8 grouped kernel against the CPU's loop and an fp8 block's saved bytes against the memory
#             model (tests/gpu/test_cuda_fp8.py)
#   train     a 1B Llama, bf16, 30 steps, no checkpoint: MFU, peak memory, each beside the cost and
#             memory models' prediction (benchmarks/gpu_check.py)
#   fp8       the same run with train.precision=fp8 (tensorwise; issue 35): MFU against the bf16 run's (over
#             the same bf16 peak: the speed-up), the share of the FP8 peak, peak memory and step time beside
#             the models' fp8 predictions, the loss after 30 steps against bf16's (fails beyond 1.5%)
#   kernels   one cp=2 ring rank's attention blocks and a document-masked layer at 16k tokens against
#             SDPA: time, parity, the cost model's time (benchmarks/gpu_kernels.py)
#   offload   activation offload's peak and step time on one pipeline rank (bench_offload.py)
#   moe       the experts' GEMMs, bf16, forward + backward: grouped (torch._grouped_mm) against padded and
#             the per-expert loop at Mixtral 8x7B's and Qwen3-30B-A3B's shapes, 8192 tokens: time between
#             synchronisations, TFLOP/s, peak memory, error against the loop (bench_expert_gemm.py)
#
#   bash benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]
#
# OUT_DIR defaults to $OUT when the environment sets it (the device tool does), else gpu_check_out.
# It finds a Python whose torch sees a GPU ($PYTHON, python3, python, .venv/bin/python, in that order)
# or fails in one line saying how to provide one. The project's pure-Python dependencies that the
# machine lacks (hydra-core, omegaconf, antlr4 on an offline GPU image) come from .whl/: `make
# gpu-wheels` here fills it (git-ignored: carry it). --dry-run runs the same six parts on this CPU with
# tiny sizes (make test does, tests/integration/test_gpu_check.py), so a typo costs no GPU minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT"
RES="$(mktemp -d)"  # the parts' JSON results, gathered into OUT/summary.json at the end
trap 'rm -rf "$RES"' EXIT

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
torch_of() { "$1" -c 'import torch; print("torch", torch.__version__ + ", no GPU visible")' 2>/dev/null || echo "no torch"; }
if [ $DRY = 1 ]; then
  PY="${PYTHON:-}"
  [ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
else
  PY="" tried=""
  for c in ${PYTHON:-} python3 python .venv/bin/python; do
    command -v "$c" >/dev/null 2>&1 || continue
    if has_cuda "$c"; then PY="$c"; break; fi
    tried="$tried $c ($(torch_of "$c"))"
  done
  if [ -z "$PY" ]; then
    echo "gpu_check: no Python here has a torch that sees a GPU (tried:${tried:- none found}); install a CUDA" \
         "build (pip install torch --index-url https://download.pytorch.org/whl/cu128) or set PYTHON=/path/to/python;" \
         "--dry-run checks this script on the CPU" >&2
    exit 2
  fi
fi

# The modules the check imports, by the package that provides them; with .whl/ there, every distribution
# of its pinned closure (.whl/requirements.txt: those packages and all they require) that this Python
# lacks, so a package installed from it arrives with its dependencies.
missing() {
  "$PY" - <<'EOF'
import importlib.metadata, importlib.util, pathlib, re
need = {"hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime", "yaml": "PyYAML",
        "pytest": "pytest", "numpy": "numpy", "transformers": "transformers", "safetensors": "safetensors"}
lack = [pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None]
pins = pathlib.Path(".whl/requirements.txt")
if lack and pins.is_file():
    lack = []
    for line in filter(None, map(str.strip, pins.read_text().splitlines())):
        req, _, marker = line.partition(";")  # a marked line: a package only some Pythons need
        if marker.strip():
            try:
                from packaging.markers import Marker
            except ImportError:
                from pip._vendor.packaging.markers import Marker
            if not Marker(marker).evaluate():
                continue
        name = re.split(r"[=<>!~ ]", req.strip())[0]
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            lack.append(req.strip())
print(" ".join(lack))
EOF
}
lack="$(missing)"
if [ -n "$lack" ]; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: $PY lacks $lack and there is no .whl/: run make gpu-wheels on a machine with an index and" \
         "carry .whl/ here" >&2
    exit 2
  fi
  # Each lacking distribution of the closure at its pin: its dependencies are in that list or already here.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links .whl --target /tmp/mpformer-site $lack \
    || { echo "gpu_check: installing $lack from .whl/ failed (pip's error above; make gpu-wheels fetches" \
              "CPython 3.10-3.13 wheels, this is $("$PY" -c 'import sys; print(sys.version.split()[0])'))" >&2; exit 2; }
  export PYTHONPATH="/tmp/mpformer-site${PYTHONPATH:+:$PYTHONPATH}"
  lack="$(missing)"
  [ -z "$lack" ] || { echo "gpu_check: still missing after .whl/: $lack; add them to make gpu-wheels" >&2; exit 2; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
[ $DRY = 1 ] && export MPFORMER_GPU_DRY_RUN=1

if [ $DRY = 1 ]; then  # the same parts, tiny, on this CPU
  TRAIN=(--device cpu --model tiny-llama --steps 3 --skip 1 --seq 64 --micro-batch 2 --global-batch 4 --sustain 0)
  KERNELS=(--device cpu --seq 1024 --heads 8 --kv-heads 2 --head-dim 32 --doc 200 --reps 1)
  OFFLOAD=(--device cpu --pp 2 --microbatches 2 --steps 1 --layers 2 --hidden 64 --heads 4 --vocab 256 --seq 64)
  MOE=(--device cpu --precision bf16 --shapes 8,2,64,64,32 128,8,32,32,16)
else
  TRAIN=(--steps 30)
  KERNELS=(--device cuda)
  OFFLOAD=(--device cuda)
  MOE=(--device cuda --precision bf16)  # its GPU shapes (bench_expert_gemm.py GPU_SHAPES; gpu_budget.py MOE_ARGS)
fi

parts=()
part() {  # name, seconds, command...: its log under OUT, its rc and time for the summary
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "== $name (timeout ${limit}s) =="
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$name.log"
  parts+=("$name:$rc:$(( $(date +%s) - t0 ))")
}
# Each part's timeout: its work rehearsed here, at an H100's rates with a stated margin (gpu_budget.py,
# which writes gpu_budget.json; tests/integration/test_gpu_check.py keeps the two in step).
budget() { "$PY" -c "import json, sys; print(json.load(open('benchmarks/gpu_budget.json'))['parts'][sys.argv[1]]['seconds'])" "$1"; }
part tests "$(budget tests)" "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider
part train "$(budget train)" "$PY" benchmarks/gpu_check.py "${TRAIN[@]}" --json "$RES/train.json"
part fp8 "$(budget fp8)" "$PY" benchmarks/gpu_check.py "${TRAIN[@]}" --precision fp8 --sustain 0 \
  --compare "$RES/train.json" --json "$RES/fp8.json"
part kernels "$(budget kernels)" "$PY" benchmarks/gpu_kernels.py "${KERNELS[@]}" --json "$RES/kernels.json"
part offload "$(budget offload)" "$PY" benchmarks/bench_offload.py "${OFFLOAD[@]}" --json "$RES/offload.json"
part moe "$(budget moe)" "$PY" benchmarks/bench_expert_gemm.py "${MOE[@]}" --json "$RES/moe.json"

"$PY" - "$OUT" "$RES" "$DRY" "${parts[@]}" <<'EOF'
import json, subprocess, sys
from pathlib import Path

import torch

out, res, dry, parts = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.TimeoutExpired) as e:
    gpu = f"nvidia-smi: {e}"
summary = {"dry_run": dry, "python": sys.executable, "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "nvidia_smi": gpu,
           "parts": []}
for p in parts:
    name, rc, seconds = p.split(":")
    f = res / f"{name}.json"
    summary["parts"].append({"name": name, "passed": rc == "0", "exit": int(rc), "seconds": int(seconds),
                             "timed_out": rc in ("124", "137"),
                             "result": json.loads(f.read_text()) if f.exists() else None})
summary["passed"] = all(p["passed"] for p in summary["parts"])
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print("gpu_check:", "passed" if summary["passed"] else "FAILED", "|", ", ".join(
    f"{p['name']} {'ok' if p['passed'] else 'exit ' + str(p['exit'])} {p['seconds']}s" for p in summary["parts"]),
    f"| {out}/summary.json")
sys.exit(0 if summary["passed"] else 1)
EOF
