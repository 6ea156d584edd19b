"""The Triton source of :func:`rollout_guard.support.head_logsumexp` (imported on first use, so that
``TRITON_INTERPRET=1`` set before then runs it in Triton's interpreter). One program per row of the LM head's
output; see :func:`rollout_guard.support.head_logsumexp` for what it computes."""

import triton
import triton.language as tl


@triton.jit
def head_logsumexp_rows(raw_ptr, ids_ptr, total_ptr, own_ptr, vocabulary, stride, scale, softcap, inv_temperature,
                        SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = raw_ptr + row.to(tl.int64) * stride
    offsets = tl.arange(0, BLOCK)
    best = -float("inf")  # running max of the row's scaled logits
    total = 0.0  # Σ exp(logit − best)
    for start in range(0, vocabulary, BLOCK):
        inside = start + offsets < vocabulary
        x = tl.load(base + start + offsets, mask=inside, other=0.0).to(tl.float32) * scale
        if SOFTCAP:  # softcap · tanh(x / softcap), tanh(y) = 1 − 2 / (exp(2y) + 1): ±1 at ±inf
            x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
        x = tl.where(inside, x * inv_temperature, -float("inf"))
        new = tl.maximum(best, tl.max(x, axis=0))
        total = total * tl.exp(best - new) + tl.sum(tl.exp(x - new), axis=0)
        best = new
    log_total = best + tl.log(total)
    own = tl.load(base + tl.load(ids_ptr + row)).to(tl.float32) * scale
    if SOFTCAP:
        own = softcap * (1.0 - 2.0 / (tl.exp(2.0 * own / softcap) + 1.0))
    tl.store(total_ptr + row, log_total)
    tl.store(own_ptr + row, own * inv_temperature - log_total)
