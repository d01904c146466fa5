#!/usr/bin/env bash
# The prepared GPU check, under 10 minutes on one GPU (its three timeouts add to 570 s): the tests
# marked `gpu` (HF parity on cuda, cuda against cpu, flash attention, bf16 training, deterministic
# resume, pinned loading, activation offload's copies), then a 1B Llama
# in bf16 for 30 steps printing MFU and peak memory beside the memory model's prediction
# (benchmarks/gpu_check.py), then activation offload's peak and step time on one pipeline rank
# (benchmarks/bench_offload.py). Without a GPU it says so and exits 0; CI never needs one.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (OUT_DIR: where the logs and JSON go; default $OUT when the
#                                                 environment sets it, as the device tool does, else gpu_check_out)
#
# Offline GPU machines without the project's pure-Python dependencies (hydra-core, omegaconf): `make
# gpu-wheels` here puts them in .whl/ (git-ignored: carry it to the machine), which this script installs
# into a private folder when it finds one; without them the CLI runs fail on the missing import.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to $PY (torch: $("$PY" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)); nothing to check"
  exit 0
fi
if ! "$PY" -c 'import hydra, omegaconf' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/mpformer-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/mpformer-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'

status=0
echo "== tests marked gpu =="
timeout 240 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" || status=1
echo "== 1B Llama, bf16, 30 steps =="
timeout 240 "$PY" benchmarks/gpu_check.py --steps 30 --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/train.log" || status=1
echo "== activation offload: rank 0 of a pp=4 1F1B, none / auto / all (issue 17: <= 1.5 micro-batches, <= 10% time) =="
timeout 90 "$PY" benchmarks/bench_offload.py --device cuda --json "$OUT/offload.json" 2>&1 | tee "$OUT/offload.log" || status=1
echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED) (logs in $OUT)"
exit $status
