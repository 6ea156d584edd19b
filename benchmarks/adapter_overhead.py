"""What the whole TRL adapter costs per step, next to a forward+backward of a ~1 B-parameter model over the same
tokens (goal: ≤ 1 % of that step).

The adapter's step is ``TrlGuard.guard_batch`` as TRL calls it: evidence from the batch, the advantage replica
check, ``RolloutGuard.inspect`` (statistics, one gather, one host copy, verdict), the quarantine action, the
evidence records (host copies of the suspect rows, full evidence for the worst ``evidence_samples_per_step``),
the TRL metrics, and handing the sinks' work to the background writer. On the writer thread, measured
separately: decoding the records' tokens with a real tokenizer (one ``batch_decode``), the quarantine store
(JSON + ``write`` + ``fsync``), ``metrics.jsonl``, the console sink, and the spike chart (``--chart-every``).

Everything the adapter does is real; only the trainer is a stand-in. The stand-in (:class:`StandInTrainer`) is
the smallest object that exposes what ``TrlGuard`` reads from a ``GRPOTrainer`` (its settings, a real
``accelerate.Accelerator``, the tokenizer, the step counter and TRL's metrics dict); building a real
``GRPOTrainer`` at 512 × 16384 tokens would need a model and generation for nothing the adapter measures. The
batch is what TRL 1.16 builds with vLLM and importance-sampling correction on: prompt and completion ids and masks,
``sampling_per_token_logps`` (engine), ``old_per_token_logps`` (trainer), ``advantages`` (TRL's arithmetic, so
the replica check passes) and ``num_items_in_batch``. Token ids are windows of real text encoded by a byte-level
BPE tokenizer (16k vocabulary) trained here on the Python standard library's sources (nothing downloaded).
Suspect rows: the trainer's logprobs of a share of the rows (``--suspect``) are shifted by −9 nats (the score
fires); the circuit breaker is off so that 50 % suspect steps run on.

Reference: forward + backward (a GRPO-style loss: log-softmax over the vocabulary, gather, × advantage) of a
Llama-style model, Llama-3.2-1B shape on CUDA (hidden 2048, 16 layers, MLP 8192, 32/8 heads, vocab 128,256:
1.24 B parameters, bf16), over a few micro-batches of ``--micro-rows`` × tokens, scaled linearly to all rows
(said in the output). On CPU a small model stands in (the ratio is then not the goal's).

    python benchmarks/adapter_overhead.py --device cpu --rows 16 --tokens 512            # minutes on a laptop
    python benchmarks/adapter_overhead.py --device cuda --out adapter_overhead.json      # 512 × 16384, H200
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import logging
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rollout_guard.outputs.sinks import Sink


# -- a real tokenizer, built here ----------------------------------------------------------------------------------

def build_tokenizer(vocab_size: int = 16_000, files: int = 150) -> tuple[Any, torch.Tensor]:
    """A byte-level BPE tokenizer trained on local Python sources, and those sources encoded (the token stream
    completions are cut from)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:files]
    text = "".join(Path(path).read_text(errors="ignore") for path in paths)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([text[i : i + 10_000] for i in range(0, len(text), 10_000)],
                             trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|eos|>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|eos|>")
    stream = torch.tensor(core.encode(text[:1_500_000]).ids, dtype=torch.long)
    return tokenizer, stream


# -- the stand-in trainer and TRL's batch ----------------------------------------------------------------------------

class StandInTrainer:
    """What ``TrlGuard`` reads from a TRL ``GRPOTrainer`` (vLLM colocate, IS correction on, one reward function)."""

    def __init__(self, tokenizer: Any, rows: int, group_size: int, output_dir: str, cpu: bool) -> None:
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=cpu)
        self.args = SimpleNamespace(output_dir=output_dir, report_to=[], per_device_train_batch_size=rows,
                                    steps_per_generation=1, generation_kwargs=None)
        self.num_generations = group_size
        self.reward_weights = torch.ones(1, device=self.accelerator.device)
        self.reward_func_names = ["reward"]
        self.scale_rewards = "group"
        self.multi_objective_aggregation = "sum_then_normalize"
        self.use_vllm, self.vllm_mode, self.vllm_importance_sampling_correction, self.rollout_func = True, "colocate", True, None
        self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty = 1.0, 1.0, 0, None, 1.0
        self.max_completion_length = None
        self.processing_class = tokenizer
        self.model = SimpleNamespace(training=True, name_or_path="stand-in", config=SimpleNamespace(_name_or_path="stand-in"))
        self.state = SimpleNamespace(global_step=0)
        self._metrics = {"train": collections.defaultdict(list)}
        self.callbacks: list = []

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def _generate_and_score_completions(self, inputs: Any) -> dict:  # wrapped by the guard, not called here
        raise NotImplementedError

    def _calculate_rewards(self, *args: Any) -> torch.Tensor:
        raise NotImplementedError

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        pass


def make_batch(stream: torch.Tensor, rows: int, tokens: int, prompt_tokens: int, suspect: float, group_size: int,
               device: torch.device, seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    """TRL's batch (what ``_generate_and_score_completions`` returns) and the rewards matrix (N, 1)."""
    from rollout_guard.action import group_relative_advantages

    generator = torch.Generator().manual_seed(seed)
    stream = stream.to(device)

    def windows(count: int, width: int) -> torch.Tensor:
        starts = torch.randint(0, stream.numel(), (count, 1), generator=generator).to(device)
        return stream[(starts + torch.arange(width, device=device)) % stream.numel()]

    lengths = torch.randint(tokens // 2, tokens + 1, (rows, 1), generator=generator).to(device)
    mask = (torch.arange(tokens, device=device) < lengths).long()
    engine = -torch.rand(rows, tokens, generator=generator).to(device) * 2
    trainer = engine + 0.02 * torch.randn(rows, tokens, generator=generator).to(device)
    corrupted = torch.randperm(rows, generator=generator)[: max(round(rows * suspect), 1 if suspect > 0 else 0)].to(device)
    trainer[corrupted] -= 9.0
    rewards = torch.rand(rows, 1, generator=generator).to(device)
    advantages = group_relative_advantages(rewards, torch.ones(1, device=device), group_size=group_size)
    batch = {
        "prompt_ids": windows(rows, prompt_tokens), "prompt_mask": torch.ones(rows, prompt_tokens, dtype=torch.long, device=device),
        "completion_ids": windows(rows, tokens), "completion_mask": mask,
        "sampling_per_token_logps": engine * mask, "old_per_token_logps": trainer * mask,
        "advantages": advantages, "num_items_in_batch": mask.sum(),
    }
    return batch, rewards


class TimedSink(Sink):
    """Wraps a sink: time spent in each of its calls (on the writer thread)."""

    def __init__(self, sink: Any, clock: dict[str, float]) -> None:
        self.sink, self.clock = sink, clock

    def _timed(self, name: str, *args: Any) -> None:
        started = time.perf_counter()
        try:
            getattr(self.sink, name)(*args)
        finally:
            self.clock[name] += time.perf_counter() - started

    def on_records(self, records, guard):  # noqa: ANN001
        self._timed("on_records", records, guard)

    def on_step(self, report, guard):  # noqa: ANN001
        self._timed("on_step", report, guard)

    def on_end(self, guard):  # noqa: ANN001
        self._timed("on_end", guard)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_adapter(tokenizer: Any, stream: torch.Tensor, args: argparse.Namespace, suspect: float, device: torch.device) -> dict:
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach as attach_module
    from rollout_guard.integrations.trl.attach import TrlGuard, default_sinks
    from rollout_guard.integrations.trl.records import decode_records

    folder = tempfile.mkdtemp(prefix="adapter_overhead_")
    trainer = StandInTrainer(tokenizer, args.rows, args.group_size, folder, cpu=device.type == "cpu")
    config = GuardConfig(max_quarantine_share=None, chart_every_steps=args.chart_every,
                         evidence_samples_per_step=args.evidence_samples, output_dir=os.path.join(folder, "rollout_guard"))
    clock: dict[str, float] = collections.defaultdict(float)
    sinks = [TimedSink(sink, clock) for sink in default_sinks([], config, Path(config.output_dir))]

    def timed_decode(records, tok):  # noqa: ANN001 - runs on the writer thread
        started = time.perf_counter()
        try:
            return decode_records(records, tok)
        finally:
            clock["decode"] += time.perf_counter() - started

    attach_module.decode_records = timed_decode
    guarded = TrlGuard(trainer, config, sinks=sinks)
    wall, inspect, overhead, suspects, full = [], [], [], [], []
    try:
        for step in range(args.warmup + args.steps):
            batch, rewards = make_batch(stream, args.rows, args.tokens, args.prompt_tokens, suspect, args.group_size, device, seed=step)
            sync(device)
            if step == args.warmup:
                guarded.flush()
                clock.clear()
            trainer.state.global_step = step
            guarded._rewards_per_func = rewards  # what the wrapped _calculate_rewards records
            started = time.perf_counter()
            guarded.guard_batch(batch)
            sync(device)
            elapsed = time.perf_counter() - started
            if step >= args.warmup:
                report = guarded.last_report
                wall.append(elapsed)
                inspect.append(report.metrics["guard_seconds"])
                overhead.append(report.metrics["overhead_seconds"])
                suspects.append(int(report.metrics["suspect"]))
                full.append(min(int(report.metrics["suspect"]), args.evidence_samples))
        drain = time.perf_counter()
        guarded.flush()
        drain = time.perf_counter() - drain
        per_step = dict(clock)  # before close(): the end-of-training chart and summary are not a step's work
        guarded.close()
    finally:
        attach_module.decode_records = decode_records
    store = Path(config.output_dir) / "quarantine"
    written = sum(path.stat().st_size for path in store.glob("*.jsonl"))
    writer_ms = 1000 * sum(per_step.values()) / args.steps
    return {
        "suspect_share": suspect, "suspect_rows": statistics.median(suspects), "full_records": statistics.median(full),
        "adapter_ms": round(1000 * statistics.median(wall), 2), "inspect_ms": round(1000 * statistics.median(inspect), 2),
        "overhead_seconds_metric_ms": round(1000 * statistics.median(overhead), 2),
        "writer_ms_per_step": round(writer_ms, 1),
        "writer_breakdown_ms_per_step": {key: round(1000 * value / args.steps, 1) for key, value in per_step.items()},
        "drain_after_last_step_ms": round(1000 * drain, 1),
        "store_mb_per_step": round(written / 2**20 / (args.warmup + args.steps), 2),
    }


# -- the reference: forward + backward of a ~1 B model ---------------------------------------------------------------

def measure_forward_backward(args: argparse.Namespace, device: torch.device) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    gpu = device.type == "cuda"
    shape = (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  vocab_size=128_256) if gpu else
             dict(hidden_size=args.cpu_hidden, intermediate_size=4 * args.cpu_hidden, num_hidden_layers=args.cpu_layers,
                  num_attention_heads=max(args.cpu_hidden // 64, 1), num_key_value_heads=max(args.cpu_hidden // 64, 1), vocab_size=16_000))
    dtype = torch.bfloat16 if gpu else torch.float32
    config = LlamaConfig(**shape, max_position_embeddings=args.tokens, tie_word_embeddings=True, attn_implementation="sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.train()
    parameters = sum(p.numel() for p in model.parameters())
    micro = min(args.micro_rows, args.rows)
    while True:
        try:
            ids = torch.randint(0, config.vocab_size, (micro, args.tokens), device=device)
            advantages = torch.randn(micro, 1, device=device)

            def step() -> None:
                logits = model(input_ids=ids).logits[:, :-1]
                logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                (-(logprobs * advantages).mean()).backward()
                model.zero_grad(set_to_none=True)

            step()  # warm-up
            sync(device)
            samples = []
            for _ in range(args.fwd_repeats):
                started = time.perf_counter()
                step()
                sync(device)
                samples.append(time.perf_counter() - started)
            break
        except torch.OutOfMemoryError:
            if micro == 1:
                raise
            micro //= 2
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    seconds = statistics.median(samples)
    return {"parameters": parameters, "dtype": str(dtype).removeprefix("torch."), "micro_rows": micro, "micro_batches_timed": len(samples),
            "micro_batch_ms": round(1000 * seconds, 1), "scaled_to_rows": args.rows,
            "fwd_bwd_ms": round(1000 * seconds * args.rows / micro, 1),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if gpu else None,
            "model": {key: value for key, value in shape.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=None, help="rows per step (default 512 on CUDA, 16 on CPU)")
    parser.add_argument("--tokens", type=int, default=None, help="completion tokens per row (default 16384 on CUDA, 512 on CPU)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--suspect", default="0.01,0.1,0.5", help="comma-separated shares of suspect rows")
    parser.add_argument("--evidence-samples", type=int, default=16, help="GuardConfig.evidence_samples_per_step")
    parser.add_argument("--chart-every", type=int, default=25, help="GuardConfig.chart_every_steps (1: redraw every step)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="timed adapter steps per share (default 4 on CUDA, 3 on CPU)")
    parser.add_argument("--micro-rows", type=int, default=2, help="rows per forward+backward micro-batch (halved on OOM)")
    parser.add_argument("--fwd-repeats", type=int, default=3)
    parser.add_argument("--cpu-hidden", type=int, default=256)
    parser.add_argument("--cpu-layers", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.rows = args.rows or (512 if gpu else 16)
    args.tokens = args.tokens or (16384 if gpu else 512)
    args.steps = args.steps or (4 if gpu else 3)
    if args.rows % args.group_size:
        args.group_size = max(d for d in range(1, args.group_size + 1) if args.rows % d == 0)
    logging.getLogger("rollout_guard").setLevel(logging.ERROR)  # the console sink's alerts would fill the table
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    started = time.perf_counter()
    tokenizer, stream = build_tokenizer()
    print(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens, trained here in {time.perf_counter() - started:.1f} s", flush=True)
    shares = [float(share) for share in args.suspect.split(",")]
    adapter = []
    for share in shares:
        row = measure_adapter(tokenizer, stream, args, share, device)
        adapter.append(row)
        print(json.dumps(row), flush=True)
    reference = measure_forward_backward(args, device)
    print(json.dumps(reference), flush=True)

    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    fwd = reference["fwd_bwd_ms"]
    print(f"\ndevice: {name}; torch {torch.__version__}; {args.rows} rows × {args.tokens} completion tokens "
          f"(+{args.prompt_tokens} prompt), evidence_samples_per_step={args.evidence_samples}, median of {args.steps} steps")
    print(f"forward+backward: Llama-style, {reference['parameters'] / 1e9:.2f} B parameters, {reference['dtype']}, "
          f"{reference['micro_batches_timed']} micro-batches of {reference['micro_rows']} × {args.tokens} timed "
          f"({reference['micro_batch_ms']:.0f} ms each), scaled linearly to {args.rows} rows: {fwd:.0f} ms")
    header = (f"{'suspect':>8} {'rows':>6} {'full':>5} {'adapter ms':>11} {'inspect ms':>11} {'metric ms':>10} "
              f"{'writer ms':>10} {'MB/step':>8} {'fwd+bwd ms':>11} {'adapter/fwd+bwd':>16}")
    print(header)
    for row in adapter:
        row["ratio"] = row["adapter_ms"] / fwd
        print(f"{row['suspect_share']:>8.0%} {row['suspect_rows']:>6.0f} {row['full_records']:>5.0f} {row['adapter_ms']:>11.1f} "
              f"{row['inspect_ms']:>11.1f} {row['overhead_seconds_metric_ms']:>10.1f} {row['writer_ms_per_step']:>10.1f} "
              f"{row['store_mb_per_step']:>8.2f} {fwd:>11.0f} {row['ratio']:>16.3%}")
    print("adapter ms: TrlGuard.guard_batch on the training thread (inspect included); metric ms: the step's "
          "overhead_seconds; writer ms: decoding, store, metrics, console and charts on the background writer thread.")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": name, "torch": torch.__version__, "rows": args.rows, "tokens": args.tokens,
                       "prompt_tokens": args.prompt_tokens, "evidence_samples_per_step": args.evidence_samples,
                       "steps": args.steps, "adapter": adapter, "forward_backward": reference,
                       "seconds": round(time.perf_counter() - started, 1)}, handle, indent=2)


if __name__ == "__main__":
    main()
