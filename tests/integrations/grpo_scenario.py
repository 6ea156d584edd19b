"""One real GRPO scenario (TRL GRPOTrainer + vLLM CPU build + tiny local model), run in its own process.

vLLM's colocated engine initialises torch.distributed and cannot be built twice in one process, so each
scenario runs here, in a fresh interpreter, and saves what the tests check to ``<out>/result.pt``.

    python tests/integrations/grpo_scenario.py SCENARIO --out DIR --model MODEL_DIR
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

SCENARIOS = {
    # name: guard mode, injection rate, learning rate, GRPOConfig overrides, GuardConfig overrides. The injection
    # rates are far above real ones so that 4 steps say something; the circuit breaker's ceiling is raised to
    # match, except in the scenario that tests it.
    "colocate": dict(mode="quarantine", rate=0.3, lr=5e-4, config={}),
    "replica_mismatch": dict(mode="quarantine", rate=0.3, lr=5e-4, config={}),
    "breaker": dict(mode="quarantine", rate=0.9, lr=5e-4, config={}, guard={"max_quarantine_share": 0.5}),
    # monitor mode with the breaker's defaults (share 0.5, on_ceiling "stop") under 90 % corruption, and a replica of
    # TRL's advantages made to differ: both must alert, and training must go on
    "monitor": dict(mode="monitor", rate=0.9, lr=5e-4, config={}, guard={"max_quarantine_share": 0.5}),
    "no_is_correction": dict(mode="quarantine", rate=0.3, lr=5e-4, config={"vllm_importance_sampling_correction": False}),
    "no_vllm": dict(mode="quarantine", rate=None, lr=5e-4, config={"use_vllm": False}),
    # the modes that check non-finite values only: NaN/+inf written into the one logprob tensor there is (rows 1, 6)
    # trainer-only: use_vllm=False with a generation serving 2 steps, so that TRL computes old logprobs itself
    "no_vllm_nan": dict(mode="quarantine", rate=None, lr=5e-4, config={"use_vllm": False, "steps_per_generation": 2},
                        nan="old_per_token_logps"),
    # engine-only: no importance-sampling correction and GuardConfig(compute_trainer_logprobs=False)
    "engine_only": dict(mode="quarantine", rate=None, lr=5e-4, config={"vllm_importance_sampling_correction": False},
                        guard={"compute_trainer_logprobs": False}, nan="sampling_per_token_logps"),
    # the engine returns a NaN logprob (vLLM's None) for the first token of rows 1 and 6, which TRL counts as a perfect
    # match in its ratio and metrics; TRL's correction also masks ratios under 0.5, so that it drops rows too
    "engine_nan": dict(mode="quarantine", rate=0.3, lr=5e-4, config={"vllm_importance_sampling_clip_min": 0.5},
                       engine_nan=True),
    "no_weight_sync": dict(mode="monitor", rate=None, lr=2e-2, config={}),
    "server": dict(mode="quarantine", rate=0.3, lr=0.0, config={"vllm_mode": "server"}),
    # TRL's default layout: a generation batch is a single group, so a foreign context must come from another step
    # a barely trained (high-entropy) policy sampled with top_k=5: vLLM's processed logprobs sit ~1.5 nats above
    # the trainer's on every token; no corruption at all, the default breaker on
    "topk_high_entropy": dict(mode="quarantine", rate=None, lr=5e-4, config={"top_k": 5}, guard={"max_quarantine_share": 0.5}),
    # the same without comparing on the engine's support: the offset stays in d and the detector's centres must absorb it
    "topk_high_entropy_offset": dict(mode="quarantine", rate=None, lr=5e-4, config={"top_k": 5},
                                     guard={"max_quarantine_share": 0.5, "compare_on_engine_support": False}),
    # mask_truncated_completions with completions cut at 6 tokens: the copies of 6–8 letters (about half) never reach
    # EOS, so TRL masks them out; the guard must still judge them (and take flagged ones out of the baseline)
    "truncated": dict(mode="quarantine", rate=0.3, lr=5e-4,
                      config={"mask_truncated_completions": True, "max_completion_length": 6}),
    # the engine-level fault of vLLM PR #32118 (stale Mamba state read by a new 1-token request) in TRL's colocate
    # engine, tiny Mamba2 model (engine bf16, trainer fp32); learning rate 0, so that the re-scoring with the
    # initial weights is the ground truth of every step. The control: the same engine settings, no fault. 48
    # rollouts a step (~330 completion tokens)
    "stale_state": dict(mode="quarantine", rate=None, lr=0.0, config={"per_device_train_batch_size": 48}),
    "stale_state_control": dict(mode="quarantine", rate=None, lr=0.0, config={"per_device_train_batch_size": 48}),
    "single_group": dict(mode="quarantine", rate=0.5, lr=5e-4, config={"per_device_train_batch_size": 4}),
    # ceiling_delta=8: the copy model's corruption (10–17 nats) stays under the default 25-nat ceiling, and this
    # scenario checks that both alert kinds reach the trackers
    # a fault that depends on engine state: rollouts are corrupted only once the engine has had 3 weight syncs;
    # engine stats on (per-request times, KV-cache usage, running requests); a KV cache of 6 blocks (128 tokens each
    # on CPU, one per request here) so that requests queue and the cache fills
    "engine_state": dict(mode="quarantine", rate=0.5, lr=5e-4, config={}, after_weight_syncs=3, engine_stats=True,
                         engine_kwargs={"num_gpu_blocks_override": 6}),
    "trackers": dict(mode="quarantine", rate=0.3, lr=5e-4, guard={"ceiling_delta": 8.0}, engine_stats=True,
                     config={"report_to": ["wandb", "trackio"], "project": "rollout-guard-test", "run_name": "trackers"}),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, port: int, log_path: Path) -> subprocess.Popen:
    from rollout_guard.integrations.vllm_cpu import cpu_server_command

    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    log = log_path.open("w")
    process = subprocess.Popen(cpu_server_command(model, port, max_model_len=64), env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(1)
    process.kill()
    raise TimeoutError(f"vLLM server did not answer /health within 240 s; see {log_path}")


def bypass_server_weight_sync() -> None:
    """Server mode on CPU: TRL's weight sync uses vLLM's NCCL weight-transfer engine, which needs CUDA (it raises
    NotImplementedError on CPU). This bypasses ONLY the weight sync (init and transfer); generation still goes
    through the real server. The scenario uses learning_rate=0, so the served weights stay the trainer's."""
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    VLLMClient.init_communicator = lambda self, device=0: None
    original_sync = VLLMGeneration.sync_weights

    def sync_weights(self):
        if self.mode != "server":
            return original_sync(self)
        if self.accelerator.is_main_process:
            self.vllm_client.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights


LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


def loss_invariance(trainer, raw: dict, guarded: dict) -> dict:
    """For each TRL loss type: the loss of the guarded batch does not change when the quarantined rows' tokens,
    logprobs and advantages are replaced by garbage; the unguarded batch's loss does (control)."""
    import torch

    quarantined = (guarded["completion_mask"].sum(dim=1) == 0) & (raw["completion_mask"].sum(dim=1) > 0)
    generator = torch.Generator().manual_seed(0)

    def garbage(batch: dict) -> dict:
        batch = dict(batch)
        ids = batch["completion_ids"].clone()
        ids[quarantined] = torch.randint(4, 30, ids[quarantined].shape, generator=generator)
        batch["completion_ids"] = ids
        for key in ("old_per_token_logps", "sampling_per_token_logps"):
            if key in batch:
                values = batch[key].clone()
                values[quarantined] = -20.0 * torch.rand(values[quarantined].shape, generator=generator)
                batch[key] = values
        advantages = batch["advantages"].clone()
        advantages[quarantined] = 5.0
        batch["advantages"] = advantages
        if "importance_sampling_ratio" in batch:  # TRL's IS correction would scale a garbage row by ~0; undo that
            ratio = batch["importance_sampling_ratio"].clone()
            ratio[quarantined] = 1.0
            batch["importance_sampling_ratio"] = ratio
        return batch

    results, saved = {}, (trainer.loss_type, trainer.importance_sampling_level)
    with torch.no_grad():
        for loss_type in LOSS_TYPES:
            trainer.loss_type = loss_type
            trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else saved[1]
            results[loss_type] = {
                "guarded": float(trainer._compute_loss(trainer.model, guarded)),
                "guarded_garbage": float(trainer._compute_loss(trainer.model, garbage(guarded))),
                "raw": float(trainer._compute_loss(trainer.model, raw)),
                "raw_garbage": float(trainer._compute_loss(trainer.model, garbage(raw))),
            }
    trainer.loss_type, trainer.importance_sampling_level = saved
    return {"quarantined_rows": int(quarantined.sum()), "losses": results}


def rescored_max_delta(model: str, batches: list) -> list:
    """Ground truth independent of the guard: each rollout re-scored with transformers (float32, the initial
    weights: learning rate 0) one sample at a time; per step, (B,) max over its tokens of |engine − re-scored|."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_guard.integrations.rescoring import rescore_per_sample

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    for batch in batches:
        prompt_mask, mask = batch["prompt_mask"].bool(), batch["completion_mask"].bool()
        prompts = [ids[m].tolist() for ids, m in zip(batch["prompt_ids"], prompt_mask, strict=True)]
        completions = [ids[m].tolist() for ids, m in zip(batch["completion_ids"], mask, strict=True)]
        rescored = rescore_per_sample(reference, prompts, completions)
        out.append(torch.tensor([
            max((abs(a - b) for a, b in zip(engine[m].tolist(), values, strict=True)), default=0.0)
            for engine, m, values in zip(batch["sampling_per_token_logps"], mask, rescored, strict=True)
        ]))
    return out


def count_no_grad_forwards(trainer) -> list:
    """Count the trainer's no-grad scoring passes (TRL's old/reference logprobs, the guard's extra pass): one entry
    of rows per call."""
    import torch

    original, calls = trainer._get_per_token_logps_and_entropies, []

    def counting(model, input_ids, *args, **kwargs):
        if not torch.is_grad_enabled():
            calls.append(int(input_ids.shape[0]))
        return original(model, input_ids, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counting
    return calls


def write_nonfinite(trainer, key: str) -> None:
    """Inside the guard (wrapped before it): NaN and +inf into ``batch[key]`` at the first token of rows 1 and 6."""
    original = trainer._generate_and_score_completions

    def corrupting(inputs):
        batch = original(inputs)
        if trainer.model.training:
            batch[key][1, 0] = float("nan")
            batch[key][6, 0] = float("inf")
        return batch

    trainer._generate_and_score_completions = corrupting


def engine_nan_logprobs(trainer) -> None:
    """Between the engine and TRL: the first token's logprob of rows 1 and 6 is None, as vLLM reports a NaN
    logprob (TRL turns it back into NaN)."""
    original = trainer._generate

    def with_nan(prompts):
        output = list(original(prompts))
        if trainer.model.training:
            for row in (1, 6):
                if output[4][row]:
                    output[4][row] = [None, *output[4][row][1:]]
        return tuple(output)

    trainer._generate = with_nan


def run(name: str, out: Path, model: str, steps: int, save_steps: int | None = None, resume_from: str | None = None) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollout_guard import CircuitBreakerTripped, GuardConfig
    from rollout_guard.testing.tiny_model import TinyModelRecipe, copy_prompt, copy_reward, random_letters
    from rollout_guard.integrations.trl import attach_guard, inject_stale_context
    from rollout_guard.integrations.vllm_cpu import enable_trl_colocate_on_vllm_cpu

    spec = SCENARIOS[name]
    settings = dict(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=16, num_generations=4,
        max_completion_length=12, learning_rate=spec["lr"], use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
        bf16=False, use_cpu=True, logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
    )
    settings.update(spec["config"])
    if save_steps:
        settings.update(save_strategy="steps", save_steps=save_steps)
    server = None
    if settings.get("vllm_mode") == "server":
        port = free_port()
        server = start_server(model, port, out / "server.log")
        settings["vllm_server_base_url"] = f"http://127.0.0.1:{port}"
        bypass_server_weight_sync()
    elif name.startswith("stale_state"):
        from rollout_guard.testing.engine_faults import enable_stale_mamba_state_fault_in_trl, stress_trl_colocate_engine

        enable_trl_colocate_on_vllm_cpu(dtype="bfloat16")  # vLLM CPU runs Mamba2 in bf16 only
        stress = enable_stale_mamba_state_fault_in_trl if name == "stale_state" else stress_trl_colocate_engine
        stress(max_num_seqs=8, num_state_slots=12)
    else:
        enable_trl_colocate_on_vllm_cpu()
    if spec.get("engine_stats"):
        from rollout_guard.integrations.trl import enable_vllm_engine_stats

        enable_vllm_engine_stats()
    if spec.get("engine_kwargs"):
        import trl.generation.vllm_generation as vllm_generation

        make_llm = vllm_generation.LLM
        vllm_generation.LLM = lambda *args, **kwargs: make_llm(*args, **{**spec["engine_kwargs"], **kwargs})
    if name == "no_weight_sync":
        from trl.generation.vllm_generation import VLLMGeneration

        VLLMGeneration.sync_weights = lambda self: None  # negative control: the engine keeps the initial weights

    rng = random.Random(1)
    recipe = TinyModelRecipe()
    dataset = Dataset.from_list([{"prompt": copy_prompt(random_letters(rng, recipe))} for _ in range(64)])

    def copy_accuracy(prompts, completions, **_):
        return [copy_reward(p, c) for p, c in zip(prompts, completions, strict=True)]

    trainer = GRPOTrainer(model=model, reward_funcs=copy_accuracy, args=GRPOConfig(**settings), train_dataset=dataset)
    no_grad_forwards = count_no_grad_forwards(trainer)
    if spec.get("nan"):
        write_nonfinite(trainer, spec["nan"])
    if spec.get("engine_nan"):
        engine_nan_logprobs(trainer)
    guard_settings = {"max_quarantine_share": 0.95, **spec.get("guard", {})}
    guarded = attach_guard(trainer, GuardConfig(mode=spec["mode"], **guard_settings), keep_steps=True)
    if spec["rate"] is not None:
        syncs = spec.get("after_weight_syncs")
        when = None if syncs is None else (lambda: guarded.engine_context.weight_version >= syncs)
        inject_stale_context(trainer, rate=spec["rate"], seed=0, when=when)
    if name in ("replica_mismatch", "monitor"):  # pretend TRL computed advantages differently from the guard's replica
        from dataclasses import replace

        guarded.settings = replace(guarded.settings, scale_rewards="none")
    truncated_passes: list = []
    if name == "truncated":  # the cost of the guard's pass over the truncated rows, per generation step
        guarded_generate = trainer._generate_and_score_completions

        def recording(inputs):
            guarded.last_truncated_pass = None
            batch = guarded_generate(inputs)
            truncated_passes.append(guarded.last_truncated_pass)
            return batch

        trainer._generate_and_score_completions = recording
    started = time.perf_counter()
    tripped = None  # the breaker scenario's CircuitBreakerTripped, raised from trainer.train()
    try:
        trainer.train(resume_from_checkpoint=resume_from)
    except CircuitBreakerTripped as error:
        if name != "breaker":
            raise
        tripped = str(error)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    kept = guarded.steps
    raw = [step.before for step in kept]
    guarded_batches = [step.after for step in kept]
    reports = [{
        "suspect": step.report.suspect, "quarantined": step.report.quarantined, "reasons": step.report.reasons,
        "samples": step.report.samples,
        "metrics": dict(step.report.metrics), "overhead_seconds": step.overhead_seconds,
        "alerts": [alert.kind for alert in step.report.alerts],
    } for step in kept]
    invariance = None
    if name == "colocate":
        usable = [
            i for i, batch in enumerate(guarded_batches)
            if batch["completion_mask"].sum(1).eq(0).any() and batch["advantages"].abs().sum() > 0
        ]
        step = usable[0]
        invariance = loss_invariance(trainer, raw[step], guarded_batches[step])
    rescored = rescored_max_delta(model, raw) if name.startswith("stale_state") else None
    fault = None
    if name.startswith("stale_state"):
        from rollout_guard.testing.engine_faults import FAULT_STATS

        fault = dict(FAULT_STATS)
    torch.save(
        {
            "rescored_max_delta": rescored, "fault_stats": fault,
            "loss_invariance": invariance, "truncated_passes": truncated_passes, "no_grad_forwards": no_grad_forwards,
            "evidence": [step.evidence for step in kept],
            "scenario": name, "raw": raw, "guarded": guarded_batches, "rewards": [step.rewards_per_func for step in kept],
            "injected": [step.injected for step in kept],
            "reports": reports, "log_history": trainer.state.log_history, "summary": guarded.guard.summary(),
            "guard_dir": str(guarded.output_dir), "train_seconds": time.perf_counter() - started,
            "guard_state": guarded.guard.state_dict(),
            "reward_weights": trainer.reward_weights.clone(), "scale_rewards": trainer.scale_rewards,
            "num_generations": trainer.num_generations,
            "global_step": trainer.state.global_step, "tripped": tripped,
            "process_index": trainer.accelerator.process_index, "num_processes": trainer.accelerator.num_processes,
        },
        out / ("result.pt" if trainer.accelerator.num_processes == 1 else f"result-rank{trainer.accelerator.process_index}.pt"),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=None)
    parser.add_argument("--resume-from", default=None)
    arguments = parser.parse_args()
    arguments.out.mkdir(parents=True, exist_ok=True)
    run(arguments.scenario, arguments.out, arguments.model, arguments.steps, arguments.save_steps, arguments.resume_from)
