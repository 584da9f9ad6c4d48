#!/bin/bash
# Issue 49's measurements in one call on a lent GPU, at most ~8 minutes: writes OUT/gpu.log (one file; the
# device tool brings back at most 8). Each part has its own time limit, and a failing part does not stop the
# others. In order of what only a GPU can tell us:
#   1. tests/test_cuda.py, tests/test_cuda_graph.py and the CUDA tests of test_inputs.py and test_state_dtypes.py:
#      the batched CUDA default against the per-tensor and CPU steps, no host-device sync, compile=True equal to
#      eager (float64, 1e-10: Muon, NorMuon, MeqMuon), cuda_graph=True equal to the eager batched step;
#   2. benchmarks/step_time.py at Llama-350M and Llama-60M shapes: MeqMuon, Muon, NorMuon eager and with
#      cuda_graph, MeqMuon and Muon with compile=True (at Llama-60M also compile with cuda_graph), the FLOP floor, per-round
#      medians and paired ratios (MeqMuon / Muon with the same flags, every row / floor);
#   3. benchmarks/gpu_diag_profile.py at both shapes: CUDA-event step times and a kernel profile of Muon and
#      MeqMuon eager, with cuda_graph and compiled (where the graphed step loses its time), the batched
#      Newton-Schulz alone against its floor.
#   4. benchmarks/gpu.py: a short Llama-60M MeqMuon training run, eager against cuda_graph=True.
# compile=True's warm-up (met: 17.2 s cold at Llama-350M) is measured by benchmarks/gpu_diag_warmup.py.
# usage (repo root): OUT=/some/dir bash benchmarks/gpu_all.sh
#
# Issue 59's calibration, one call of its own (~1-3 minutes of parts, well inside a 15-minute loan with the
# machine's start): OUT=/some/dir bash benchmarks/gpu_all.sh calibration
#   benchmarks/ns_calibrate.py times the batched bf16 and float32 Newton-Schulz of every matrix shape of Llama-3
#   8B/70B/405B, the DeepSeek-V3-like MoE and the paper's Llama-60M/350M (22 shapes, smallest first; what is
#   done is written after each shape, so a cut leaves a valid file) into OUT/ns_calibration.json, which
#   benchmarks/time_model.py reads (--calibration; copy it to benchmarks/calibration/<gpu>.json).
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
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

if [ "${1:-}" = calibration ]; then
  part calibration 420 $PY benchmarks/ns_calibrate.py --out "$OUT/ns_calibration.json" --budget-s 360
  echo "=== done $(date -u +%T)" >> "$log"
  exit 0
fi
part tests 150 $PY -m pytest -q -p no:cacheprovider -rs --durations=6 tests/test_cuda.py tests/test_cuda_graph.py \
  "tests/test_inputs.py::test_a_cuda_tensor_lr_is_refused"
part state 35 $PY -m pytest -q -p no:cacheprovider tests/test_state_dtypes.py -k cuda
# Llama-350M in two runs: every row holds its parameters, gradients and state, and a graph its private pool
# (11 rows in one run: out of memory on an H100's 80 GB)
part step350 80 $PY benchmarks/step_time.py --device cuda --model llama-350m --optimizers meqmuon muon normuon \
  --cuda-graph --repeats 9
part step350c 100 $PY benchmarks/step_time.py --device cuda --model llama-350m --optimizers meqmuon muon \
  --compile --repeats 9
part step60 80 $PY benchmarks/step_time.py --device cuda --model llama-60m --optimizers meqmuon muon normuon \
  --cuda-graph --compile --repeats 15
part profile 110 $PY benchmarks/gpu_diag_profile.py --models llama-350m llama-60m --no-graph --top 10 --optimizers \
  muon "muon (cuda graph)" "muon (compile)" meqmuon "meqmuon (cuda graph)" "meqmuon (compile)"
part train60 70 bash -c "for a in '' '--cuda-graph'; do $PY benchmarks/gpu.py --model llama-60m --batch 16 \
  --no-compile --steps 15 --warmup 3 --optimizer meqmuon \$a; done"
echo "=== done $(date -u +%T)" >> "$log"
