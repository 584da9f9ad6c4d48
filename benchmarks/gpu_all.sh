#!/bin/bash
# Every GPU check and benchmark in one call, for a lent GPU (device time is scarce: one prepared call).
# Run from the repo root on the GPU machine; writes OUT/gpu.log (all output, one file: the device tool
# brings back at most 8).
# Each part has its own time limit, and a failing part does not stop the others. The parts, in order
# of what only a GPU can tell us:
#   1. tests/test_cuda.py and the CUDA test of test_inputs.py: the batched CUDA default against the
#      per-tensor and CPU steps, no host-device sync (cuda sync debug mode), compile=True on CUDA;
#   2. benchmarks/step_time.py on cuda at Llama-60M shapes (against torch Muon+AdamW), with MeqMuon's
#      Newton-Schulz variants (quintic, gram, Polar Express 4);
#   3. benchmarks/gpu.py: Llama-350M training tokens/s, MFU and optimizer share (batched, per-tensor,
#      compile=True), then Llama-60M tokens/s (the horizon comparison's GPU budget);
#   4. `meqmuon train` end to end on cuda (harness, bf16 autocast, --compile) on the built-in corpus;
#   5. step_time.py at Llama-350M shapes; 6. benchmarks/ns_methods.py on cuda in bf16 (Gram, quintic).
# usage: OUT=/some/dir bash benchmarks/gpu_all.sh [PEAK_TFLOPS]   (989: H100 SXM; H200 the same chip)
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"; PEAK=${1:-989}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
log=$OUT/gpu.log
part() {  # NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s" | tee -a "$log"
}
{ nvidia-smi -L; $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"; git rev-parse --short HEAD 2>/dev/null; } >> "$log" 2>&1

part tests 100 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py "tests/test_inputs.py::test_a_cuda_tensor_lr_is_refused"
part step60 45 $PY benchmarks/step_time.py --device cuda --model llama-60m --ns-variants quintic gram quintic:4:polar_express
part train350 200 bash -c "for a in '--optimizer adamw' '--optimizer muon' '--optimizer meqmuon' \
  '--optimizer meqmuon --foreach off' '--optimizer normuon' '--optimizer meqmuon --opt-compile'; do
  $PY benchmarks/gpu.py --peak-tflops $PEAK --steps 20 \$a; done"
part train60 45 bash -c "for a in adamw meqmuon; do $PY benchmarks/gpu.py --model llama-60m --batch 64 --peak-tflops $PEAK --steps 20 --optimizer \$a; done"
part harness 75 $PY -m meqmuon train --model llama-60m --data builtin --optimizer meqmuon --steps 50 --global-batch 32 \
  --micro-batch 32 --seq-len 256 --val-tokens 16384 --eval-every 50 --compile --device cuda --out /tmp/harness-run
part step350 40 $PY benchmarks/step_time.py --device cuda --model llama-350m --optimizers meqmuon muon
part ns 30 $PY benchmarks/ns_methods.py --device cuda --dtype bfloat16 --models llama-60m,llama-350m --methods quintic,gram
echo "=== done $(date -u +%T)" >> "$log"
