"""What the guard costs per step, next to what the step already costs.

Times ``RolloutGuard.inspect`` with :class:`GuardConfig`'s defaults (the detector's judgement and update,
statistics, histogram, verdict, aggregates and its one device→host copy) on random B×T logprobs with a few
corrupted rows, median of repeated runs after warm-up, and the extra device memory it allocates. For scale, it also times one no-grad forward pass of a Llama-style model over the same
B×T tokens: the work the trainer does anyway to get its logprobs (TRL's importance-sampling pass).

    python benchmarks/guard_overhead.py                        # CPU, small sizes
    python benchmarks/guard_overhead.py --device cuda --out bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard


def make_batch(rows: int, length: int, device: torch.device, seed: int = 0) -> RolloutEvidence:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    engine = -torch.rand(rows, length, generator=generator) * 2
    trainer = engine + 0.02 * torch.randn(rows, length, generator=generator)
    trainer[: max(rows // 100, 1)] -= 9.0  # ~1 % corrupted
    lengths = torch.randint(length // 4, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return RolloutEvidence(mask=mask.to(device), engine_logprobs=engine.to(device), trainer_logprobs=trainer.to(device))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn, device: torch.device, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def reference_forward(rows: int, length: int, device: torch.device, hidden: int, layers: int, repeats: int) -> float | None:
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(vocab_size=32_000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 128, 1), num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=length)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, 32_000, (rows, length), device=device)
    chunk_tokens = (1 << 16) if device.type == "cuda" else (1 << 12)  # logits are tokens × vocab: bound them
    chunk = max(1, min(rows, chunk_tokens // length))

    @torch.no_grad()
    def forward() -> None:
        for start in range(0, rows, chunk):
            logits = model(input_ids=ids[start : start + chunk]).logits
            torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[start : start + chunk].unsqueeze(-1))

    seconds = time_it(forward, device, repeats, warmup=1)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default=None, help="comma-separated ROWSxTOKENS (default depends on the device)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=None, help="reference model width (default 2048 on GPU, 256 on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="reference model depth (default 16 on GPU, 4 on CPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    sizes = args.sizes or ("64x1024,256x2048,1024x4096,512x16384" if gpu else "16x256,64x512,128x1024")
    hidden, layers = args.hidden or (2048 if gpu else 256), args.layers or (16 if gpu else 4)
    rows_out = []
    for size in sizes.split(","):
        rows, length = (int(part) for part in size.lower().split("x"))
        evidence = make_batch(rows, length, device)
        guard = RolloutGuard(GuardConfig(), device=device)
        step = iter(range(1, 10**9))
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        seconds = time_it(lambda: guard.inspect(evidence, step=next(step)), device, args.repeats)
        extra_mib = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if gpu else None
        input_mib = sum(t.element_size() * t.numel() for t in (evidence.mask, evidence.engine_logprobs, evidence.trainer_logprobs)) / 2**20
        forward = reference_forward(rows, length, device, hidden, layers, 2) if rows * length <= (2**22 if gpu else 2**17) else None
        row = {
            "rows": rows, "tokens_per_row": length, "tokens": rows * length, "guard_ms": round(seconds * 1000, 3),
            "guard_ns_per_token": round(seconds * 1e9 / (rows * length), 3),
            "guard_extra_memory_mib": None if extra_mib is None else round(extra_mib, 1), "input_mib": round(input_mib, 1),
            "reference_forward_ms": None if forward is None else round(forward * 1000, 2),
            "guard_over_forward": None if forward is None else round(seconds / forward, 5),
        }
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    header = f"{'rows×tokens':>14} {'guard ms':>10} {'ns/token':>9} {'extra MiB':>10} {'input MiB':>10} {'fwd ms':>9} {'guard/fwd':>10}"
    print(f"\ndevice: {torch.cuda.get_device_name(device) if gpu else 'cpu'}; reference forward: Llama {layers}×{hidden}, "
          f"vocab 32000, {'bf16' if gpu else 'fp32'}\n{header}")
    for row in rows_out:
        fwd = "-" if row["reference_forward_ms"] is None else f"{row['reference_forward_ms']:.1f}"
        ratio = "-" if row["guard_over_forward"] is None else f"{row['guard_over_forward']:.2%}"
        mem = "-" if row["guard_extra_memory_mib"] is None else f"{row['guard_extra_memory_mib']:.1f}"
        print(f"{row['rows']:>6}×{row['tokens_per_row']:<7} {row['guard_ms']:>10.3f} {row['guard_ns_per_token']:>9.3f} {mem:>10} "
              f"{row['input_mib']:>10.1f} {fwd:>9} {ratio:>10}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
                       "reference_model": {"hidden": hidden, "layers": layers, "vocab": 32000}, "rows": rows_out}, handle, indent=2)


if __name__ == "__main__":
    main()
