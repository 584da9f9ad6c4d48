#!/bin/bash
# Issue 58's queue: runs the lines of JOBS ("SETTING OPTIMIZER LR SEED", in order) LANES at a time, one thread
# each, from a clean clone of the library pinned at a commit (CODE), and appends start/end lines to RUNS/jobs.log.
# A setting names the model, data and length (README, "Settings"):
#   p600      pysrc-600: llama-tiny, 4,096-id BPE (RUNS/pysrc-data), batch 8 x 128, 600 updates
#   1x, 4x    horizon-micro: llama-micro, 1,280-id BPE (RUNS/pysrc-1280), batch 32 x 128, 1,143 / 4,572 updates
#   r1x       1x with the 2026 presets' upstream recipes (code CODE_R), each at its recipe's weight decay
#   w24, w48, w96   the width study: llama-micro-w24, llama-micro, llama-micro-w96 (code CODE_W), 572 updates
# Every run: float32 (--precision fp32 and ns_dtype=float32; AdamW takes no ns_dtype), evaluation on the first
# 65,536 held-out tokens, checkpoints kept (all of them: the selection counters live in the optimizer state).
# Resumable: after an interruption remove RUNS/queue-<JOBS>.next and start it again: jobs that ended with rc=0 are
# skipped, interrupted ones resume from their last checkpoint. Copy this script out of the worktree before
# starting it (bash reads a script as it runs).
# usage: CODE=/work/exp58 CODE_W=... CODE_R=... RUNS=/work/runs58 nice -n 19 queue.sh JOBS
# (a job whose code directory does not exist yet waits for it: the recipes' clone is made once their code is done)
set -u
jobs_file=$1
CODE=${CODE:?a clean clone of the library}; RUNS=${RUNS:?the run root}; LANES=${LANES:-2}
CODE_W=${CODE_W:-$CODE}; CODE_R=${CODE_R:-$CODE}
log=$RUNS/jobs.log; next=$RUNS/queue-$(basename "$jobs_file").next; mkdir -p "$RUNS/logs"; [ -f "$next" ] || echo 1 > "$next"

run_one() {  # SETTING OPTIMIZER LR SEED
  local set=$1 opt=$2 lr=$3 seed=$4 args=() code=$CODE
  case $set in
    p600) args=(--model llama-tiny --data "$RUNS/pysrc-data" --seq-len 128 --global-batch 8 --steps 600
                --eval-every 300 --save-every 100) ;;
    1x) args=(--model llama-micro --data "$RUNS/pysrc-1280" --steps 1143 --eval-every 1143 --save-every 500) ;;
    4x) args=(--model llama-micro --data "$RUNS/pysrc-1280" --steps 4572 --eval-every 4572 --save-every 500) ;;
    r1x) code=$CODE_R
         # each recipe's weight decay (meqmuon/optim/presets_2026.py); the harness's default would be 0.1
         case $opt in muon-plus) wd=0.05 ;; muon-vs) wd=0.1 ;; muonh) wd=0 ;; aurora) wd=0.025 ;; *) wd=0.1 ;; esac
         args=(--model llama-micro --data "$RUNS/pysrc-1280" --steps 1143 --eval-every 1143 --save-every 500
               --weight-decay "$wd") ;;
    w24|w96) code=$CODE_W
             args=(--model "llama-micro-$set" --data "$RUNS/pysrc-1280" --steps 572 --eval-every 572 --save-every 286) ;;
    w48) code=$CODE_W
         args=(--model llama-micro --data "$RUNS/pysrc-1280" --steps 572 --eval-every 572 --save-every 286) ;;
    *) echo "unknown setting $set" >&2; return 2 ;;
  esac
  [ "$opt" = adamw ] || args+=(--optimizer-arg ns_dtype=float32)
  while [ ! -d "$code" ]; do sleep 60; done
  local start; start=$(date +%s)
  echo "start $(date -u +%FT%TZ) $set $opt $lr $seed" >> "$log"
  (cd "$code" && PYTHONPATH=$code python3 -m meqmuon sweep --optimizers "$opt" --lrs "$lr" --seeds "$seed" \
     "${args[@]}" --precision fp32 --val-tokens 65536 --keep-checkpoints 100 --threads 1 --quiet \
     --out "$RUNS/$set") > "$RUNS/logs/$set-$opt-$lr-s$seed.log" 2>&1
  local rc=$? end; end=$(date +%s)
  echo "end $(date -u +%FT%TZ) $set $opt $lr $seed rc=$rc wall_s=$((end - start)) git=$(git -C "$code" rev-parse --short HEAD)" >> "$log"
}

lane() {
  while true; do
    local n line
    n=$(flock "$next" -c "n=\$(cat '$next'); echo \$((n + 1)) > '$next'; echo \$n")
    line=$(sed -n "${n}p" "$jobs_file")
    [ -z "$line" ] && return
    case $line in \#*) continue ;; esac
    grep -qF " $line rc=0 " "$log" 2>/dev/null && continue  # ended well before: skip
    # shellcheck disable=SC2086
    run_one $line
  done
}

for _ in $(seq "$LANES"); do lane & sleep 2; done
wait
