"""Re-scoring: the trainer-side logprob of every sampled token given its prompt, with transformers.

``rescore`` is what ``rollout-guard audit`` uses: rows are sorted by length and packed into batches under a
token budget (right padding, so positions stay those of the unpadded sequence), one forward pass per batch, and
the log-softmax is taken only at the completion positions (``(tokens, vocab)`` instead of ``(rows, width,
vocab)``). ``rescore_per_sample`` is the faithful reference it is checked and timed against: one forward pass per
sample over prompt + completion, as a two-phase "generate with vLLM, then re-score with transformers" script
does. ``benchmarks/rescoring_throughput.py`` measures the ratio.

Logprobs are of ``logits / temperature`` (as TRL's trainer computes them), in float32 whatever the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def length_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_rows: int) -> list[list[int]]:
    """Row indices grouped into batches, shortest first, each with ``rows × longest ≤ max_batch_tokens`` (a row
    longer than the budget gets a batch of its own) and at most ``max_batch_rows`` rows.

    >>> length_batches([5, 1, 3, 9], max_batch_tokens=16, max_batch_rows=8)
    [[1, 2, 0], [3]]
    """
    order = sorted(range(len(lengths)), key=lambda index: lengths[index])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = lengths[index]  # ascending: the newest row is the longest
        if current and ((len(current) + 1) * width > max_batch_tokens or len(current) >= max_batch_rows):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def rescore(model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
            temperature: float = 1.0,
            max_batch_tokens: int = 16384, max_batch_rows: int = 256,
            on_batch: Callable[[int], None] | None = None) -> list[list[float]]:
    """Logprob of each completion token given its prompt, batched; ``on_batch(rows)`` after each batch.

    Empty completions give empty lists. Rows are returned in the input order.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"prompts and completions: {len(prompts)} vs {len(completions)} rows; "
                         "pass one completion per prompt")
    device = next(model.parameters()).device
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    out: list[list[float]] = [[] for _ in prompts]
    for batch in length_batches(lengths, max_batch_tokens, max_batch_rows):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        rows, positions, targets = [], [], []
        for slot, index in enumerate(batch):
            prompt, completion = list(prompts[index]), list(completions[index])
            sequence = torch.tensor(prompt + completion, dtype=torch.long)
            ids[slot, : len(sequence)] = sequence
            attention[slot, : len(sequence)] = 1
            # the logprob of token t sits at position t - 1
            rows.append(torch.full((len(completion),), slot, dtype=torch.long))
            positions.append(torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion)))
            targets.append(torch.tensor(completion, dtype=torch.long))
        logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
        row, position, target = (torch.cat(x).to(device) for x in (rows, positions, targets))
        picked = logits[row, position].float() / temperature  # (tokens, vocab)
        token_logprobs = (picked.gather(-1, target.unsqueeze(-1)).squeeze(-1) - picked.logsumexp(dim=-1)).cpu()
        start = 0
        for index in batch:
            count = len(completions[index])
            out[index] = token_logprobs[start : start + count].tolist()
            start += count
        if on_batch is not None:
            on_batch(len(batch))
    return out


@torch.no_grad()
def rescore_per_sample(model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                       temperature: float = 1.0) -> list[list[float]]:
    """The reference: one forward pass per sample over prompt + completion, full log-softmax, then the slice."""
    device = next(model.parameters()).device
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor([list(prompt) + list(completion)], dtype=torch.long, device=device)
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / temperature, dim=-1)
        picked = logprobs.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        out.append(picked[len(prompt) - 1 :].cpu().tolist())
    return out
