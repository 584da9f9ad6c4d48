#!/bin/bash
# Issue 49's diagnosis on a lent GPU, one call of at most ~150 s: writes OUT/diag.log (one file).
#   (a., compile=True against eager with variants of the per-tensor graph, went with that graph: git history)
#   c. a kernel profile of one batched MeqMuon and Muon step at Llama-60M and 350M shapes, the NS floor,
#      and a CUDA-graph capture of the eager step as it is (benchmarks/gpu_diag_profile.py);
#   b. compile=True warm-up at Llama-60M and (capped) 350M: per graph, first step, counters
#      (benchmarks/gpu_diag_warmup.py).
# Each part has its own time limit, and a failing part does not stop the others.
# usage (repo root): OUT=/some/dir bash benchmarks/gpu_diag.sh
set -u
OUT=${OUT:-/tmp/gpu-diag}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
PY=${PY:-python3}
log=$OUT/diag.log
part() {  # NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s" | tee -a "$log"
}
{ nvidia-smi -L; $PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; git rev-parse --short HEAD 2>/dev/null; } >> "$log" 2>&1

part profile 40 $PY benchmarks/gpu_diag_profile.py --models llama-60m llama-350m --optimizers meqmuon muon --repeats 5
part warmup60 24 env TORCH_LOGS=recompiles $PY benchmarks/gpu_diag_warmup.py --model llama-60m --cap 21
part warmup350 30 env TORCH_LOGS=recompiles $PY benchmarks/gpu_diag_warmup.py --model llama-350m --cap 27
echo "=== done $(date -u +%T)" >> "$log"
