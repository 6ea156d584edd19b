#!/usr/bin/env bash
# GRPO on GSM8K with verl 0.9's v1 trainer and rollout_guard between the old-logprob pass and the advantages.
# Needs GPUs, a vLLM (or SGLang) rollout and `pip install "rollout-guard[verl]"`; GSM8K in verl's parquet format
# (verl's examples/data_preprocess/gsm8k.py). The guard's lines are the last three overrides: the trainer mode
# selects the guarded trainer, the other two are optional settings (GuardConfig fields, `+rollout_guard.<field>`).
set -euo pipefail
DATA=${DATA:-$HOME/data/gsm8k}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.calculate_log_probs=true \
    trainer.logger='["console","wandb"]' \
    trainer.project_name=rollout_guard \
    trainer.experiment_name=gsm8k_grpo_guarded \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.total_epochs=3 \
    trainer.v1.trainer_mode=guarded_sync \
    +rollout_guard.mode=quarantine \
    +rollout_guard.max_quarantine_share=0.5 \
    "$@"
