#!/usr/bin/env bash
# The study (docs/study.md) as a user runs it: the local stack on PostgreSQL, the warm
# start through its deployment, every cell of configs/sweeps/study_household_medium.yaml through the sweep
# deployment (concurrency from the sweep file), then docs/results.md. Run it again to resume: a finished
# warm start registers nothing new, finished cells are skipped, a killed cell resumes from its checkpoint.
#   nohup scripts/study.sh > study.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
# Two cells at once on two cores: one compute thread each (torch's OpenMP threads spin while they wait);
# the worker started by `stack up` passes this on to every flow run.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if ! $BIN/horizonrl stack status | grep -q "^worker: running"; then
    $BIN/horizonrl stack up --database postgres
fi
export PREFECT_API_URL=http://127.0.0.1:4200/api MLFLOW_TRACKING_URI=http://127.0.0.1:5000
$BIN/prefect --no-prompt deploy --all
$BIN/prefect deployment run warmstart/warmstart --param config_path=configs/warmstart_household_medium.yaml \
    --watch --watch-timeout 86400
$BIN/prefect deployment run sweep/sweep --param sweep_path=configs/sweeps/study_household_medium.yaml \
    --param out=docs/results.md --watch --watch-timeout 2592000
