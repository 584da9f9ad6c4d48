#!/bin/bash
# One lane of the restart after the machine reset (2026-11-28 08:2x UTC): its own jobs file (jobs-C.txt or
# jobs-D.txt), then the width jobs (jobs-W.txt) shared with the other lane: both lanes take jobs-W.txt's lines from
# one counter file under flock, so no line runs twice. queue-run.sh is a copy of this directory's queue.sh outside
# the worktree (bash reads a script as it runs). Started as: nohup setsid nice -n 19 bash lane.sh jobs-C.txt
export CODE=/work/exp58 CODE_W=/work/exp58w RUNS=/work/runs58 LANES=1
bash /work/runs58/queue-run.sh "/work/runs58/$1"
bash /work/runs58/queue-run.sh /work/runs58/jobs-W.txt
