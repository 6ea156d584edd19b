"""Re-scoring throughput: batched ``rescore`` (what ``rollout-guard audit`` uses) vs the faithful per-sample loop.

Both score the same rollouts with the same model in one run; the script prints tokens per second of each, the
ratio (goal ≥ 10×) and the largest logprob difference between them. The model is a randomly initialised
Llama-style (or Mamba2) model of the given size: throughput does not depend on the weights. Rollouts have varied
prompt and completion lengths, as an audit's do.

    python benchmarks/rescoring_throughput.py                      # Llama-style, 4 × 256, vocab 32000, 256 rows
    python benchmarks/rescoring_throughput.py --architecture mamba2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from rollout_guard.integrations.rescoring import rescore, rescore_per_sample

GOAL = 10.0


def build_model(architecture: str, hidden: int, layers: int, vocab: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, Mamba2Config

    if architecture == "llama":
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                             num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32, max_position_embeddings=1024)
    else:
        config = Mamba2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, expand=2, head_dim=32,
                              num_heads=2 * hidden // 32, n_groups=1, state_size=16, chunk_size=16)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", choices=("llama", "mamba2"), default="llama")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--completion-tokens", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = build_model(args.architecture, args.hidden_size, args.layers, args.vocab, dtype).to(args.device)
    synchronize = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rng = random.Random(0)
    prompts = [[rng.randrange(args.vocab) for _ in range(rng.randint(*args.prompt_tokens))] for _ in range(args.rows)]
    completions = [[rng.randrange(args.vocab) for _ in range(rng.randint(*args.completion_tokens))] for _ in range(args.rows)]
    tokens = sum(map(len, completions))
    rescore(model, prompts[:4], completions[:4])  # warm-up
    rescore_per_sample(model, prompts[:4], completions[:4])

    synchronize()
    started = time.perf_counter()
    batched = rescore(model, prompts, completions, max_batch_tokens=args.max_batch_tokens)
    synchronize()
    batched_s = time.perf_counter() - started
    started = time.perf_counter()
    loop = rescore_per_sample(model, prompts, completions)
    synchronize()
    loop_s = time.perf_counter() - started

    difference = max(abs(a - b) for x, y in zip(batched, loop, strict=True) for a, b in zip(x, y, strict=True))
    ratio = loop_s / batched_s
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, torch threads {torch.get_num_threads()}"
    print(f"model: {args.architecture} {args.layers} × {args.hidden_size}, vocab {args.vocab}, {args.dtype}, {where}")
    print(f"rollouts: {args.rows}, completion tokens: {tokens}, prompt tokens: {sum(map(len, prompts))}")
    print(f"per-sample loop: {loop_s:8.2f} s  {tokens / loop_s:10.0f} tokens/s")
    print(f"batched rescore: {batched_s:8.2f} s  {tokens / batched_s:10.0f} tokens/s")
    print(f"ratio: {ratio:.1f}x (goal >= {GOAL:.0f}x): {'PASS' if ratio >= GOAL else 'FAIL'}")
    print(f"max |batched - per-sample| logprob: {difference:.2e} nats")


if __name__ == "__main__":
    main()
