"""How good is the fidelity benchmark's stand-in for the trainer's log-mass of the engine's support?

``benchmarks/fidelity.py --same-support`` moves the trainer's logprob by the *engine's* recorded ``log Z``
(processed − raw logprob of the same decode step) plus a Gaussian error with the sd of the condition's own
engine-vs-trainer noise (raw − trainer), because the rollouts do not record the trainer's own ``log Z``. Exact,
the guard sees ``d = raw − trainer + (log Z_trainer − log Z_engine)``; the stand-in draws that last term as
``N(0, sd(raw − trainer))``. This script measures the term itself: it trains the benchmark's model the same way
(``fidelity_data/make_h200_rollouts.py``: same corpus, tokenizer, architecture, optimiser; shorter), samples with
its bf16 KV-cache engine under top-k, scores with the trainer (full forward, bf16 weights and fp32 weights under
bf16 autocast, as the data's trainers) and computes the trainer's ``log Z`` from its full logits
(:func:`rollout_guard.support.kept_log_mass`). It prints, per top-k and trainer, the sd and tail quantiles of
``log Z_trainer − log Z_engine`` next to those of ``raw − trainer``.

    python benchmarks/support_standin.py --arch llama --train-seconds 60 --out standin.json   # one H200: ~2 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fidelity_data"))
sys.path.insert(0, str(HERE.parent))

import make_h200_rollouts as data  # noqa: E402

from rollout_guard.support import kept_log_mass  # noqa: E402


@torch.no_grad()
def trainer_side(model, prompts: list[list[int]], completions: list[list[int]], temperature: float, top_k: int,
                 device: str, autocast: bool, chunk: int = 32) -> tuple[list[float], list[float]]:
    """Per completion token (flattened): the trainer's logprob and its ``log Z`` of the top-k support."""
    logprobs, masses = [], []
    for batch_prompts, batch_completions, ids, logits in data.scored_chunks(model, prompts, completions, temperature,
                                                                             chunk, device, autocast):
        lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        mass = kept_log_mass(logits, top_k=top_k)
        for i, (prompt, completion) in enumerate(zip(batch_prompts, batch_completions, strict=True)):
            logprobs += lp[i, len(prompt) - 1:len(prompt) - 1 + len(completion)].tolist()
            masses += mass[i, len(prompt) - 1:len(prompt) - 1 + len(completion)].tolist()
    return logprobs, masses


def spread(values: torch.Tensor) -> dict:
    absolute = values.abs()
    return {"sd": float(values.std()), "mean_abs": float(absolute.mean()),
            **{f"abs_q{q}": float(torch.quantile(absolute, q / 100)) for q in (50, 99, 99.9)},
            "abs_max": float(absolute.max()), "tokens": values.numel()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=["llama", "falcon_h1"], default="llama")
    parser.add_argument("--train-seconds", type=float, default=60.0)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, nargs="+", default=[20, 5])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few rows: a CPU check of the script")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = args.device
    torch.manual_seed(0)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    train_blocks, prompt_blocks = data.corpus(Path(__import__("sysconfig").get_paths()["stdlib"]))
    if args.smoke:
        train_blocks = train_blocks[:300]
    tokenizer = data.load_or_train_tokenizer(HERE / "fidelity_data" / "stdlib_bpe8k.json", train_blocks, 8192)
    encode = lambda blocks: [e.ids for e in tokenizer.encode_batch(blocks)]  # noqa: E731
    flat = [t for ids in encode(train_blocks) for t in [data.BOS, *ids, data.EOS]]
    tokens = torch.tensor(flat, dtype=torch.int32, device=device)
    if args.arch == "falcon_h1":
        data.patch_falcon_h1_scan(device)
    model = data.build_model(args.arch, "tiny" if args.smoke else "full", tokenizer.get_vocab_size()).to(device)
    settings = SimpleNamespace(seq_len=64 if args.smoke else 512, batch_size=4 if args.smoke else (64 if args.arch == "llama" else 32),
                               lr=1e-3, warmup_steps=5 if args.smoke else 50, seed=0, train_seconds=args.train_seconds)
    _, record = data.train(model, tokens, settings, device)
    engine = data.bf16_copy(model)
    prompts = data.Prompts([ids for ids in encode(prompt_blocks) if len(ids) >= 40], 0)
    gen = torch.Generator(device=device).manual_seed(1)
    results = {"arch": args.arch, "training": record, "device": torch.cuda.get_device_name() if device == "cuda" else device,
               "temperature": args.temperature, "by_top_k": {}}
    for top_k in args.top_k:
        contexts = prompts.draw(args.rows, 16, 64)
        started = time.time()
        completions, processed, raw, _ = data.sample(engine, contexts, args.temperature, 1.0, top_k, args.max_tokens, device, gen)
        processed = torch.tensor([v for row in processed for v in row])
        raw = torch.tensor([v for row in raw for v in row])
        engine_mass = processed - raw  # −log Z_engine ≥ 0
        entry = {"sample_seconds": round(time.time() - started, 1), "engine_offset": spread(engine_mass)}
        for name, (scorer, autocast) in {"hf-forward-bf16": (engine, False),
                                         "hf-forward-fp32-autocast-bf16": (model, True)}.items():
            trainer_lp, trainer_mass = (torch.tensor(v) for v in trainer_side(scorer, contexts, completions, args.temperature,
                                                                              top_k, device, autocast))
            ok = torch.isfinite(raw) & torch.isfinite(trainer_lp)
            entry[name] = {"raw_minus_trainer": spread((raw - trainer_lp)[ok]),
                           "log_z_trainer_minus_engine": spread((trainer_mass + engine_mass)[ok]),
                           "exact_on_support": spread((processed - (trainer_lp - trainer_mass))[ok])}
            line = entry[name]
            print(f"{args.arch} top_k={top_k} {name}: raw−trainer sd {line['raw_minus_trainer']['sd']:.4f} "
                  f"(|.| 99.9 % {line['raw_minus_trainer']['abs_q99.9']:.3f}, max {line['raw_minus_trainer']['abs_max']:.3f}); "
                  f"log Z trainer − engine sd {line['log_z_trainer_minus_engine']['sd']:.4f} "
                  f"(|.| 99.9 % {line['log_z_trainer_minus_engine']['abs_q99.9']:.3f}, max {line['log_z_trainer_minus_engine']['abs_max']:.3f}); "
                  f"engine offset sd {entry['engine_offset']['sd']:.3f}; {line['raw_minus_trainer']['tokens']} tokens", flush=True)
        results["by_top_k"][str(top_k)] = entry
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
