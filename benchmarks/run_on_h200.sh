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
PART=${PART:-all}  # "bench": the one-GPU benchmarks only; "runs": the GRPO runs only (each fits one 10-minute call);
# "fidelity": the fidelity benchmark (below); "sharded": the GRPO example under FSDP1, FSDP2 and DeepSpeed ZeRO-3 on
# one GPU (deepspeed and its deps on PYTHONPATH)
if [ "$PART" = fidelity ]; then
  # benchmarks/fidelity.py --device cuda --same-support for each of RUNS ("name|seconds|options;..."), JOBS at a time,
  # each with nproc / JOBS CPU threads (four side by side taking all 16 cores each finished none in 530 s); every
  # results JSON as <name>.json and the logs in one archive ($OUT brings back 8 files at most).
  # typer, click and shellingham travel in the ignored .whl/ folder (typer imports rich only if it is there).
  mkdir -p /tmp/runs /tmp/py /tmp/results
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/py .whl/*.whl > /dev/null 2>&1
  export PYTHONPATH=/tmp/py:$PWD OMP_NUM_THREADS=$(( $(nproc) / ${JOBS:-1} ))
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/env.txt" 2>&1
  fidelity_run() {
    IFS='|' read -r name limit extra <<< "$1"
    /usr/bin/time -v timeout "$limit" python3 benchmarks/fidelity.py --device cuda --same-support $extra \
        --out "/tmp/runs/$name" > "/tmp/runs/$name.log" 2>&1
    echo "$name exit $? $(date +%T)" >> /tmp/runs/status.txt
    # after each run, so that what finished comes back if the call is cut off
    flock /tmp/results.lock bash -c "cp /tmp/runs/$name/results-*.json /tmp/results/$name.json 2>/dev/null;
                                     tar czf $OUT/results.tgz -C /tmp results"
  }
  export -f fidelity_run
  IFS=';' read -ra runs <<< "${RUNS:?RUNS=\"name|seconds|options;...\"}"
  printf '%s\0' "${runs[@]}" | xargs -0 -P "${JOBS:-1}" -I{} bash -c 'fidelity_run "$1"' _ {}
  cat /tmp/runs/status.txt
  tar czf "$OUT/logs.tgz" --exclude='*.png' --exclude='sweep-*' --exclude='results-*' -C /tmp runs
  exit 0
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  timeout 200 python3 benchmarks/statistics_speed.py --device cuda --repeats 100 --out "$OUT/statistics_speed.json" 2>&1 | grep -v '^{' | tee "$OUT/statistics_speed.log"
  timeout 200 python3 benchmarks/guard_overhead.py --device cuda --out "$OUT/bench_guard_overhead.json" 2>&1 | tail -n 12 | tee "$OUT/bench.log"
  timeout 300 python3 benchmarks/adapter_overhead.py --device cuda --out "$OUT/adapter_overhead.json" 2>&1 | tail -n 12 | tee "$OUT/adapter_overhead.log"
fi
[ "$PART" = bench ] && exit 0
launch="python3 -m accelerate.commands.launch --num_machines 1 --mixed_precision no --dynamo_backend no"
if [ "$PART" = sharded ]; then
  # The guard's support hook (top_k = 5, trainer compared on the engine's support) and TransformersRollouts under
  # sharded training on one process: FSDP1, FSDP2 and DeepSpeed ZeRO-3 (which empties every parameter outside its
  # module's forward). One process shows the wrapping, unsharding and gathering mechanics, not a split of weights.
  fsdp="$launch --num_processes 1 --use_fsdp --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer"
  # ZeRO-3 partitions every parameter (persistence threshold 0: by default parameters under 100,000 elements, all
  # of the tiny model's, stay whole), prefetches none and keeps none live for reuse (by default up to 1e9 elements:
  # the whole tiny model), so that the LM head is empty outside its own forward, as a large model's is.
  cat > /tmp/zero3.json <<'JSON'
{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                       "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 1},
 "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
 "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
JSON
  zero3="$launch --num_processes 1 --use_deepspeed --deepspeed_config_file /tmp/zero3.json"
  for run in "zero3_inject|$zero3|--top-k 5" \
             "zero3_flat|$zero3|--top-k 5 --flat --rate 0" \
             "fsdp2_inject|$fsdp --fsdp_version 2|--top-k 5" \
             "fsdp1_inject|$fsdp --fsdp_version 1 --fsdp_sharding_strategy FULL_SHARD --fsdp_use_orig_params true|--top-k 5" \
             "zero3_inject_bf16|$zero3|--top-k 5 --bf16"; do
    IFS='|' read -r name how extra <<< "$run"
    [[ " ${SHARDED:-$name} " == *" $name "* ]] || continue  # SHARDED="fsdp1_inject ...": only those runs
    rm -rf "/tmp/$name"; mkdir -p /tmp/sharded  # a fresh output folder; logs and checks in one archive: $OUT brings back 8 files at most
    timeout 150 $how examples/two_process_grpo.py --out "/tmp/$name" --steps 4 --timeout 120 $extra > "/tmp/sharded/$name.log" 2>&1
    echo "$name exit $?" | tee -a "$OUT/status.txt"; cp "/tmp/$name/checks.json" "/tmp/sharded/${name}_checks.json" 2>/dev/null
    tar czf "$OUT/sharded.tgz" -C /tmp sharded
  done
  for f in /tmp/sharded/*_checks.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], d['world_size'], d['all_passed'], d['checks'])" "$f"; done
  exit 0
fi
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
