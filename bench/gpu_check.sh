#!/usr/bin/env bash
# The whole GPU check in one command, for a machine with a CUDA GPU, torch (2.11-2.13) and no
# package index: installs the carried wheels, runs `pytest -m gpu`, then bench/gpu.py. Logs and
# the table go to $OUT (default ./gpu_out). Under 10 minutes on one H100.
#
#   bench/gpu_check.sh [pytest|bench|all] [bench/gpu.py arguments...]
#   BENCH_NAME=deepseek_v3 bench/gpu_check.sh bench --models deepseek_v3   # MoE/MLA, engine only
#
# Env: OUT (results folder), WHEELS (folder of carried wheels, default .whl; docs/gpu.md lists
# them and the command that downloads them), TITAN_ASSETS_DIR (the bundled corpus and tokenizer;
# built in seconds when missing), PYTEST_TIMEOUT / BENCH_TIMEOUT (seconds for each part),
# BENCH_NAME (the bench's log and JSON file names, default bench).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
what=${1:-all}
[ $# -gt 0 ] && shift
OUT=${OUT:-$here/gpu_out}
WHEELS=${WHEELS:-$here/.whl}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
    "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "-")'
} 2>&1 | tee -a "$OUT/env.txt"

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  site=${SITE:-/tmp/titan-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$WHEELS"/*.whl 2>&1 | tail -3 | tee -a "$OUT/env.txt"
  export PYTHONPATH="$site:$here${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c 'import titan_core.train, tyro; print("engine imports: ok")' 2>&1 | tee -a "$OUT/env.txt"
"$PY" -m titan_core.data.assets >/dev/null 2>&1 || echo "bundled assets: build failed" >>"$OUT/env.txt"

rc=0
if [ "$what" = all ] || [ "$what" = pytest ]; then
  per_test=()  # pytest-timeout, where installed: one hung test does not eat the whole part
  "$PY" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 240)
  timeout "${PYTEST_TIMEOUT:-300}" "$PY" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider \
    -q -rA "${per_test[@]}" 2>&1 | tee "$OUT/pytest.log"
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  name=${BENCH_NAME:-bench}  # several bench runs in one $OUT: bench_b4.log, ...
  timeout "${BENCH_TIMEOUT:-420}" "$PY" bench/gpu.py --json "$OUT/$name.json" "$@" 2>&1 |
    tee "$OUT/$name.log"
  rc=$((rc | ${PIPESTATUS[0]}))
fi
echo "gpu_check: exit $rc" | tee -a "$OUT/env.txt"
exit $rc
