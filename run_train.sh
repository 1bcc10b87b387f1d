#!/usr/bin/env bash
# Launch titan_core.train under torchrun on this host.
#   NGPU=2 MODULE=llama3 CONFIG=llama3_debugmodel ./run_train.sh --training.steps 20
# Env: NGPU (processes, default 1), MODULE/CONFIG (registry), CONFIG_FILE (TOML),
# LOG_RANK (comma-separated ranks whose output is shown, default 0), COMM_MODE (fake_backend or
# local_tensor: one process simulates NGPU ranks, see titan_core/comm_mode.py).
# Further arguments are config overrides (--section.field value).
set -euo pipefail

NGPU=${NGPU:-1}
LOG_RANK=${LOG_RANK:-0}
MODULE=${MODULE:-llama3}
CONFIG=${CONFIG:-llama3_debugmodel}
CONFIG_FILE=${CONFIG_FILE:-}
COMM_MODE=${COMM_MODE:-}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -x "$here/.venv/bin/python" ] && [ -z "${VIRTUAL_ENV:-}" ]; then
  PATH="$here/.venv/bin:$PATH"
fi

args=(--module "$MODULE" --config "$CONFIG")
[ -n "$CONFIG_FILE" ] && args+=(--job.config_file "$CONFIG_FILE")
[ -n "$COMM_MODE" ] && args+=(--comm.mode "$COMM_MODE")

export PYTHONUNBUFFERED=1
# A fresh rendezvous store per torchrun restart (torch's shared one keeps a dead attempt's keys).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
# torchrun's --tee tags each line [rankN]: so the engine's logger adds no tag of its own.
export TITAN_LOG_RANK_PREFIX=0
if [ -n "$COMM_MODE" ]; then
  # Debug modes: ONE process simulates all NGPU ranks on fake process groups (fake_backend:
  # dry run of the plan + one fake step; local_tensor: real numerics). No torchrun.
  exec python -m titan_core.train "${args[@]}" --comm.fake_world_size "$NGPU" "$@"
fi
# OMP threads per process: torch's default oversubscribes when several ranks share the cores.
if [ "$NGPU" -gt 1 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
  export OMP_NUM_THREADS=1
fi

exec torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m titan_core.train "${args[@]}" "$@"
