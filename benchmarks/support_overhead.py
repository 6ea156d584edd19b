"""What comparing on the engine's support costs (``GuardConfig.compare_on_engine_support``), next to the pass it
rides on: TRL 1.16's scoring pass (backbone + fused LM head, ``trl.trainer.utils.add_fused_lm_head``) over the
same tokens.

The hook's work per completion token: one more LM-head projection (TRL's fused head never keeps the logits) and
``kept_log_mass`` (top-k: a ``topk`` of the vocabulary; top-p: a sort of it). Measured: the scoring pass alone and
with the hook (``rollout_guard.integrations.trl.support.token_log_mass`` on the backbone's hidden states, as the
adapter's hook runs it), under top_k = 20, top_p = 0.9 and both; peak memory of each; a simpler
hook that copies each tile's logits to float32 (:func:`float32_copy_token_log_mass`) beside the adapter's, with the
largest difference of their outputs. Next to them, the training pass of the same batch
(forward with grad through the fused head, backward), so that the hook's share of a step's trainer-side compute
(scoring + training) is printed too; the step's generation, not run here, only lowers it. Model: Llama-style, random
weights built here; on CUDA Qwen2.5-1.5B's shape (hidden 1536, 28 layers, MLP 8960, 12/2 heads, vocab 151,936)
in bf16, on CPU a small one (the ratio is then not a GPU's).

    python benchmarks/support_overhead.py --device cpu --rows 4 --tokens 256
    python benchmarks/support_overhead.py --device cuda --rows 16 --tokens 1024 --out support_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import rollout_guard.integrations.trl.support as support
from rollout_guard.integrations.trl.support import logit_transform, token_log_mass
from rollout_guard.support import kept_log_mass, scaled_logits

SETTINGS = {"top_k=20": (20, 1.0, 0.0), "top_p=0.9": (0, 0.9, 0.0), "top_k=20,top_p=0.9": (20, 0.9, 0.0)}


def float32_copy_token_log_mass(hidden, ids, head, scale, softcap, temperature, settings):
    """A simpler hook, for comparison: a float32 copy of each tile's logits, scaled in place,
    ``torch.logsumexp`` over it and :func:`kept_log_mass` of the whole tile (a ``topk`` of float32 logits)."""
    top_k, top_p, min_p = settings
    flat, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)
    vocabulary = head.weight.shape[0]
    tile = max(1, support.TILE_ELEMENTS // vocabulary)
    masses, own = [], []
    for start in range(0, flat.shape[0], tile):
        logits = scaled_logits(head(flat[start : start + tile]), scale, softcap, temperature)
        total = torch.logsumexp(logits, dim=-1)
        masses.append(kept_log_mass(logits, top_k=top_k, top_p=top_p, min_p=min_p, total=total))
        own.append(logits.gather(-1, flat_ids[start : start + tile].unsqueeze(-1)).squeeze(-1) - total)
    return torch.cat(masses).reshape(ids.shape), torch.cat(own).reshape(ids.shape)


IMPLEMENTATIONS = {"adapter": token_log_mass, "float32_copy": float32_copy_token_log_mass}


def build_model(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    if device == "cuda":
        config = LlamaConfig(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                             num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=4096)
        dtype = torch.bfloat16
    else:
        config = LlamaConfig(hidden_size=256, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=32_000, max_position_embeddings=4096)
        dtype = torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    add_fused_lm_head(model)
    return model


def timed(function, device: str, repeats: int) -> tuple[float, float]:
    """Median seconds of ``function()`` over ``repeats`` (after one warm-up), and its peak memory (GiB, CUDA)."""
    function()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=16, help="rows per scoring chunk (TRL's per-device batch)")
    parser.add_argument("--tokens", type=int, default=1024, help="completion tokens per row (prompt: 128 more)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tile-elements", type=int, nargs="*", default=[support.TILE_ELEMENTS],
                        help="logits per tile of the hook's projection (each value measured)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(args.device)
    width = args.tokens
    ids = torch.randint(0, model.config.vocab_size, (args.rows, 128 + width), device=args.device)
    labels = ids.clone()
    labels[:, :-width] = -100
    backbone, head = model.base_model, model.get_output_embeddings()
    scale, softcap = logit_transform(model.config)

    def score():
        with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            return model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs

    results = {"device": args.device, "rows": args.rows, "completion_tokens": width, "vocab": model.config.vocab_size,
               "hidden": model.config.hidden_size, "layers": model.config.num_hidden_layers}
    seconds, peak = timed(score, args.device, args.repeats)
    results["scoring_pass"] = {"seconds": seconds, "peak_gib": peak}

    def train_pass():
        model.train()
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        out.log_probs.float().sum().backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    training, training_peak = timed(train_pass, args.device, args.repeats)
    results["training_pass"] = {"seconds": training, "peak_gib": training_peak}
    print(f"{args.device}: {args.rows} rows × {width} completion tokens, vocab {model.config.vocab_size}, "
          f"hidden {model.config.hidden_size}, {model.config.num_hidden_layers} layers")
    print(f"  TRL scoring pass (fused LM head): {1000 * seconds:8.1f} ms, peak {peak:.2f} GiB")
    print(f"  training pass (forward + backward): {1000 * training:8.1f} ms, peak {training_peak:.2f} GiB")
    for tile in args.tile_elements:
        support.TILE_ELEMENTS = tile
        for name, settings in SETTINGS.items():
            outputs = {}
            for implementation, function in IMPLEMENTATIONS.items():
                def hook(module, hook_args, hook_kwargs, output, settings=settings, function=function,
                         implementation=implementation):
                    hidden = output.last_hidden_state
                    outputs[implementation] = function(hidden[:, -width - 1 : -1], ids[:, -width:], head, scale,
                                                       softcap, 1.0, settings)

                handle = backbone.register_forward_hook(hook, with_kwargs=True)
                try:
                    with_hook, peak_hook = timed(score, args.device, args.repeats)
                finally:
                    handle.remove()
                extra = with_hook - seconds
                share = extra / (seconds + training)  # of the trainer-side compute of a step without the hook
                results[f"{name} tile={tile} {implementation}"] = {
                    "seconds": with_hook, "extra_seconds": extra, "ratio": extra / seconds,
                    "share_of_scoring_and_training": share, "peak_gib": peak_hook, "tile_elements": tile}
                print(f"  + support hook ({implementation:8s}), {name:18s} tile {tile:>10d}: "
                      f"{1000 * with_hook:8.1f} ms (+{1000 * extra:7.1f} ms, {100 * extra / seconds:5.1f} % of the pass, "
                      f"{100 * share:4.1f} % of scoring + training), peak {peak_hook:.2f} GiB")
            (mass, own), (mass_before, own_before) = outputs["adapter"], outputs["float32_copy"]
            difference = {"log_z": float((mass - mass_before).abs().max()),
                          "own": float((own - own_before).abs().max())}
            results[f"{name} tile={tile} adapter-vs-float32_copy"] = difference
            print(f"    adapter vs float32 copy: max |Δ log Z| {difference['log_z']:.2e}, "
                  f"max |Δ log p(id)| {difference['own']:.2e}")
    if args.out:
        with open(args.out, "w") as handle_out:
            json.dump(results, handle_out, indent=1)


if __name__ == "__main__":
    main()
