#!/usr/bin/env bash
# The thirty-third session's speed run on one lent H200: benchmarks/statistics_speed.py at its GPU sizes (the guard's
# step next to TRL's mismatch-metric ops, the changepoint score in its kernel and in torch, the step with the rule
# off), output in $OUT/statistics_speed.{json,log}.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cd benchmarks && timeout "${LIMIT:-280}" python3 statistics_speed.py --device cuda --rounds "${ROUNDS:-5}" \
    --out "$OUT/statistics_speed.json" > "$OUT/statistics_speed.log" 2>&1
echo "statistics_speed exit $?"
tail -12 "$OUT/statistics_speed.log"
