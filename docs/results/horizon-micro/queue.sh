#!/bin/bash
# Issue 39's queue: runs the lines of JOBS ("OPTIMIZER LR SEED", in order) two at a time, one thread
# each, and starts a run only if it can finish before FINISH_BY (UTC, e.g. 18:50), judged by the longest
# of the phase's last two finished runs (EST_S seconds before any has finished; the last two, not all, so
# that runs slowed by other work or paused for a timing stop no longer count once the cores are free
# again). Appends start/end lines to RUNS/jobs.log.
# --steps: sweep's base is the demo config (100 updates), so it needs the length spelled out; PHASE 1x
# is 1,143 = ceil(20 x 233,904 / (32 x 128)) updates, the 20-tokens-per-parameter run of `meqmuon train`,
# 4x is 4,572. Runs go to RUNS/PHASE (AdamW: RUNS/PHASE-adamw). Start it as `nice -n 19 queue.sh ...`
# beside other work. Resumable: after an interruption remove RUNS/queue-<JOBS>.next and start it again:
# jobs that ended with rc=0 are skipped, interrupted ones resume from their last checkpoint (every 500 updates).
# Issue 48's optimizers (muon-plus, muon-vs, muonh, aurora, meqmuon-shape) run through it unchanged: grid48-1x.txt.
# usage: queue.sh JOBS FINISH_BY   (environment: WT worktree, RUNS run root, PHASE 1x|4x, EST_S, LANES,
# DONE: optional space-separated jobs.log copies whose rc=0 jobs are skipped as well, e.g. jobs48.log)
set -u
jobs_file=$1; finish_by=$(date -u -d "$2" +%s)
WT=${WT:-/work/wt39}; RUNS=${RUNS:-/work/runs39}; EST_S=${EST_S:-900}; LANES=${LANES:-2}; PHASE=${PHASE:-1x}
case $PHASE in 1x) STEPS=1143 ;; 4x) STEPS=4572 ;; *) echo "PHASE must be 1x or 4x" >&2; exit 2 ;; esac
log=$RUNS/jobs.log; next=$RUNS/queue-$(basename "$jobs_file").next; mkdir -p "$RUNS/logs"; [ -f "$next" ] || echo 1 > "$next"

run_one() {  # OPTIMIZER LR SEED
  local opt=$1 lr=$2 seed=$3 out=$RUNS/$PHASE args=()
  if [ "$opt" = adamw ]; then out=$RUNS/$PHASE-adamw; else args=(--optimizer-arg ns_dtype=float32); fi
  local start; start=$(date +%s)
  echo "start $(date -u +%FT%TZ) $PHASE $opt $lr $seed" >> "$log"
  (cd "$WT" && PYTHONPATH=$WT python -m meqmuon sweep --optimizers "$opt" --lrs "$lr" --seeds "$seed" \
     --model llama-micro --data "$RUNS/pysrc-1280" --precision fp32 "${args[@]}" --steps $STEPS \
     --eval-every $STEPS --save-every 500 --val-tokens 65536 --threads 1 --quiet --out "$out") > "$RUNS/logs/$PHASE-$opt-$lr-s$seed.log" 2>&1
  local rc=$? end; end=$(date +%s)
  echo "end $(date -u +%FT%TZ) $PHASE $opt $lr $seed rc=$rc wall_s=$((end - start)) git=$(git -C "$WT" rev-parse --short HEAD)" >> "$log"
}

estimate() {  # the longer wall time of the phase's last two finished runs (one per lane), else EST_S
  local m; m=$(grep " $PHASE " "$log" 2>/dev/null | grep -o 'rc=0 wall_s=[0-9]*' | cut -d= -f3 | tail -2 | sort -n | tail -1)
  echo "${m:-$EST_S}"
}

lane() {
  while true; do
    local n line
    n=$(flock "$next" -c "n=\$(cat '$next'); echo \$((n + 1)) > '$next'; echo \$n")
    line=$(sed -n "${n}p" "$jobs_file")
    [ -z "$line" ] && return
    # resumable: a job that already ended well is skipped (restart with the .next file removed); one that
    # started and did not end is run again, and `meqmuon sweep` resumes it from its last checkpoint
    # DONE (optional): further logs of the same lines kept in git (jobs48.log), so a fresh machine skips them too
    cat "$log" ${DONE:-} 2>/dev/null | grep -qF " $PHASE $line rc=0 " && continue
    if [ $(( $(date +%s) + $(estimate) )) -gt "$finish_by" ]; then
      echo "skip $(date -u +%FT%TZ) $line (estimate $(estimate) s would end after $2)" >> "$log"; return
    fi
    # shellcheck disable=SC2086
    run_one $line
  done
}

for _ in $(seq "$LANES"); do lane "$jobs_file" "$2" & sleep 2; done
wait
