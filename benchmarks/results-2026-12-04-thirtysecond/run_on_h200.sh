#!/usr/bin/env bash
# The thirty-second session's fidelity runs on one lent H200 (no internet there): benchmarks/fidelity.py with
# --device cuda (the fused kernel, the change-point score beside it) and the change-point rule on at a 0.02 %
# budget. typer and its small dependencies travel in the ignored .whl/ folder. The runs go one after the other (four
# side by side, each taking the host's 16 cores, ran ~10x slower: none finished in 530 s; one alone, told, 62 s);
# each brings back its results JSON (as <run>.json) and the logs in logs.tgz. RUNS="name|seconds|options;..."
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/runs /tmp/py
pip install -q --no-index --no-deps --target /tmp/py .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/py:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L > /tmp/runs/env.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> /tmp/runs/env.txt 2>&1
rule="--device cuda ${RULE:---set changepoint_budget=0.0002}"  # RULE: another --set (thirty-third session)
IFS=';' read -ra runs <<< "${RUNS:-told-4000|280|--same-support --faults-per-condition 4000;seed1|80|--same-support --seed 1;dense|80|--same-support --dense-phase2;untold|70|--same-support --no-announce-sampling;off|80|}"
for run in "${runs[@]}"; do
  IFS='|' read -r name limit extra <<< "$run"
  /usr/bin/time -v timeout "$limit" python3 benchmarks/fidelity.py $rule $extra --out "/tmp/runs/$name" \
      > "/tmp/runs/$name.log" 2>&1
  echo "$name exit $?" >> /tmp/runs/status.txt
  cp "/tmp/runs/$name/results-defaults.json" "$OUT/$name.json" 2>/dev/null
done
cat /tmp/runs/status.txt
tar czf "$OUT/logs.tgz" --exclude='*.png' --exclude='sweep-*' --exclude='results-*' -C /tmp runs
