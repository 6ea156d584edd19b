#!/usr/bin/env bash
# What ran on the lent H200 (one GPU; torch, transformers, tokenizers, pyarrow there; no vLLM, no internet): the
# Llama-style model and the FalconH1 hybrid, each in its own process, at the same time on the one GPU; then the
# summary. Run from a folder holding make_h200_rollouts.py, rollout_schema.py, load.py, summarize.py and
# stdlib_bpe8k.json (the device call copied benchmarks/fidelity_data/ to .device/). Everything fits in ~9 minutes;
# $OUT gets 8 files at most: 2+2 clean parquet parts, 2 fault files, summary.json, run.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/meta
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
nvidia-smi -L
python3 -c "import torch, transformers, tokenizers, pyarrow; print('torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'pyarrow', pyarrow.__version__)"
python3 -c 'import sysconfig; print("stdlib", sysconfig.get_paths()["stdlib"])'
python3 make_h200_rollouts.py --arch llama --tokenizer stdlib_bpe8k.json --out "$OUT" --target-tokens 3000000 "$@" > /tmp/llama.log 2>&1 &
LLAMA=$!
python3 make_h200_rollouts.py --arch falcon_h1 --tokenizer stdlib_bpe8k.json --out "$OUT" "$@" > /tmp/hybrid.log 2>&1 &
HYBRID=$!
sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
wait $LLAMA; echo "llama exit $?"
wait $HYBRID; echo "hybrid exit $?"
mv "$OUT"/*_meta.json /tmp/meta/ 2>/dev/null
python3 summarize.py "$OUT"/*.parquet --json "$OUT/summary.json" --md /tmp/summary.md --per-step --meta /tmp/meta/*.json > /tmp/summary.log 2>&1
echo "summary exit $?"
{ cat /tmp/summary.log; echo; echo "=== llama log"; grep -v Warning /tmp/llama.log; echo; echo "=== hybrid log"; grep -v Warning /tmp/hybrid.log; } > "$OUT/run.log"
grep -E "trained|done|falcon_h1:|model |train:|Error|error" /tmp/llama.log /tmp/hybrid.log | cut -c1-400
ls -la "$OUT"
cat /tmp/summary.md
