#!/bin/bash
# Issue 49's measurements in one call on a lent GPU, at most ~6 minutes: writes OUT/gpu.log (one file; the
# device tool brings back at most 8). Each part has its own time limit, and a failing part does not stop the
# others. In order of what only a GPU can tell us:
#   1. tests/test_cuda.py, tests/test_cuda_graph.py and the CUDA tests of test_inputs.py and test_state_dtypes.py:
#      the batched CUDA default against the per-tensor and CPU steps, no host-device sync, compile=True equal to
#      eager (float64, 1e-10: Muon, NorMuon, MeqMuon), cuda_graph=True equal to the eager batched step;
#   2. benchmarks/step_time.py at Llama-60M and Llama-350M shapes: MeqMuon, Muon, NorMuon with and without
#      cuda_graph, the Newton-Schulz switches (symmetric products), the FLOP floor, per-round medians and
#      paired ratios (MeqMuon / Muon with the same flags, every row / floor);
#   3. compile=True warm-up at Llama-60M and Llama-350M (capped; per graph as it compiles);
#   4. benchmarks/gpu.py: a short Llama-60M training comparison, eager against cuda_graph=True.
# usage (repo root): OUT=/some/dir bash benchmarks/gpu_all.sh [PEAK_TFLOPS]   (989: H100 SXM; H200 the same chip)
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"; PEAK=${1:-989}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
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
SWITCHES=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import step_time; print(*sorted(step_time.SWITCHES))" 2>/dev/null)

part tests 125 $PY -m pytest -q -p no:cacheprovider -rs --durations=6 tests/test_cuda.py::test_cuda_compile_equals_eager \
  tests/test_cuda_graph.py tests/test_cuda.py::test_cuda_step_makes_no_host_device_sync \
  tests/test_cuda.py::test_cuda_batched_default_equals_per_tensor_and_cpu "tests/test_inputs.py::test_a_cuda_tensor_lr_is_refused"
part state 35 $PY -m pytest -q -p no:cacheprovider tests/test_state_dtypes.py -k cuda
part step60 40 $PY benchmarks/step_time.py --device cuda --model llama-60m --optimizers meqmuon muon normuon \
  --cuda-graph ${SWITCHES:+--switches $SWITCHES} --repeats 9
part step350 50 $PY benchmarks/step_time.py --device cuda --model llama-350m --optimizers meqmuon muon normuon \
  --cuda-graph ${SWITCHES:+--switches $SWITCHES} --repeats 7
part warmup60 35 $PY benchmarks/gpu_diag_warmup.py --model llama-60m --cap 32
part warmup350 45 $PY benchmarks/gpu_diag_warmup.py --model llama-350m --cap 42
part train60 25 bash -c "for a in '' '--cuda-graph'; do $PY benchmarks/gpu.py --model llama-60m --batch 16 \
  --no-compile --steps 15 --warmup 3 --peak-tflops $PEAK --optimizer meqmuon \$a; done"
echo "=== done $(date -u +%T)" >> "$log"
