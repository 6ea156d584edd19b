#!/usr/bin/env bash
# The thirty-eighth session's runs on one lent H200 (no internet there), the first on a GPU since the per-token cap
# (rollout_guard.changepoint.TOKEN_CAP, thirty-seventh session): SPEED=1 times the guard's step, the capped Triton
# kernel and TRL's mismatch-metric ops side by side (benchmarks/statistics_speed.py, 5 interleaved rounds); then
# benchmarks/fidelity.py --device cuda for each of RUNS ("name|seconds|options;..."), one after the other, each
# bringing back its results JSON as <name>.json; logs in logs.tgz. typer, click and shellingham travel in the ignored
# .whl/ folder (typer imports rich only if it is there).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/runs /tmp/py
pip install -q --no-index --no-deps --target /tmp/py .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/py:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L > /tmp/runs/env.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> /tmp/runs/env.txt 2>&1
if [ "${SPEED:-0}" = 1 ]; then
  (cd benchmarks && timeout "${SPEED_LIMIT:-200}" python3 statistics_speed.py --device cuda --rounds 5 \
      --out /tmp/runs/statistics_speed.json > /tmp/runs/statistics_speed.log 2>&1)
  echo "statistics_speed exit $?" >> /tmp/runs/status.txt
  cp /tmp/runs/statistics_speed.json "$OUT/" 2>/dev/null
  grep -v '^{' /tmp/runs/statistics_speed.log | tail -14
fi
IFS=';' read -ra runs <<< "${RUNS:-}"
for run in "${runs[@]}"; do
  IFS='|' read -r name limit extra <<< "$run"
  /usr/bin/time -v timeout "$limit" python3 benchmarks/fidelity.py --device cuda --same-support $extra \
      --out "/tmp/runs/$name" > "/tmp/runs/$name.log" 2>&1
  echo "$name exit $?" >> /tmp/runs/status.txt
  cp "/tmp/runs/$name/results-defaults.json" "$OUT/$name.json" 2>/dev/null
done
cat /tmp/runs/status.txt
tar czf "$OUT/logs.tgz" --exclude='*.png' --exclude='sweep-*' --exclude='results-*' -C /tmp runs
