#!/usr/bin/env bash
# What ran on the lent H200 machine(s) (no vLLM, no internet there): the guard's speed against TRL's metric ops,
# its GPU overhead and the whole adapter's per-step cost on one GPU, then examples/two_process_grpo.py on two GPUs (NCCL) in fp32 and bf16, and on one GPU. Wheels for trl,
# datasets and this project travel in .whl/ (see the closing note of the two-GPU issue). Outputs go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export ROLLOUT_GUARD_CACHE=/tmp/rgcache TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/env.txt"
python3 -c "import torch, transformers, accelerate, trl, datasets, pyarrow; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'trl', trl.__version__, 'pyarrow', pyarrow.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | tee -a "$OUT/env.txt"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
PART=${PART:-all}  # "bench": the one-GPU benchmarks only; "runs": the GRPO runs only (each fits one 10-minute call)
if [ "$PART" != runs ]; then
  timeout 200 python3 benchmarks/statistics_speed.py --device cuda --repeats 100 --out "$OUT/statistics_speed.json" 2>&1 | grep -v '^{' | tee "$OUT/statistics_speed.log"
  timeout 200 python3 benchmarks/guard_overhead.py --device cuda --out "$OUT/bench_guard_overhead.json" 2>&1 | tail -n 12 | tee "$OUT/bench.log"
  timeout 300 python3 benchmarks/adapter_overhead.py --device cuda --out "$OUT/adapter_overhead.json" 2>&1 | tail -n 12 | tee "$OUT/adapter_overhead.log"
fi
[ "$PART" = bench ] && exit 0
launch="python3 -m accelerate.commands.launch --num_machines 1 --mixed_precision no --dynamo_backend no"
if [ "$GPUS" -ge 2 ]; then
  timeout 300 $launch --multi_gpu --num_processes 2 examples/two_process_grpo.py --out /tmp/two_fp32 --steps 8 --timeout 120 > "$OUT/two_gpu_fp32.log" 2>&1
  echo "two GPUs fp32 exit $?" | tee -a "$OUT/status.txt"; cp /tmp/two_fp32/checks.json "$OUT/two_gpu_fp32_checks.json"
  timeout 300 $launch --multi_gpu --num_processes 2 examples/two_process_grpo.py --out /tmp/two_bf16 --steps 8 --bf16 --timeout 120 > "$OUT/two_gpu_bf16.log" 2>&1
  echo "two GPUs bf16 exit $?" | tee -a "$OUT/status.txt"; cp /tmp/two_bf16/checks.json "$OUT/two_gpu_bf16_checks.json"
fi
timeout 200 python3 examples/two_process_grpo.py --out /tmp/one --steps 8 > "$OUT/one_gpu_fp32.log" 2>&1
echo "one GPU fp32 exit $?" | tee -a "$OUT/status.txt"; cp /tmp/one/checks.json "$OUT/one_gpu_fp32_checks.json"
timeout 200 python3 examples/two_process_grpo.py --out /tmp/one_bf16 --steps 8 --bf16 > "$OUT/one_gpu_bf16.log" 2>&1
echo "one GPU bf16 exit $?" | tee -a "$OUT/status.txt"; cp /tmp/one_bf16/checks.json "$OUT/one_gpu_bf16_checks.json"
for f in "$OUT"/*_checks.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], d['world_size'], d['all_passed'], d['checks'])" "$f"; done
