"""Clean rollouts with real bf16 engine-vs-trainer mismatch, plus model-generated faulty ones (GPU; tiny on CPU).

    # one architecture per process; on the H200 both ran at once (run_h200.sh):
    python make_h200_rollouts.py --arch llama --tokenizer stdlib_bpe8k.json --out OUT
    python make_h200_rollouts.py --arch falcon_h1 --tokenizer stdlib_bpe8k.json --out OUT
    # CPU smoke test of the whole pipeline (tiny model, a few small steps, ~1 minute):
    python make_h200_rollouts.py --arch falcon_h1 --smoke --device cpu --out /tmp/smoke

1. Corpus: the ``.py`` files of this Python's standard library (site-/dist-packages left out), cut into top-level
   blocks (a def or class with its decorators; module preambles); one file in ten (by a hash of its path) is held
   out and gives the prompts, so the model continues code it was not trained on.
2. Tokenizer: byte-level BPE (``tokenizers``), 8192 tokens, ``<pad>``=0 ``<s>``=1 ``</s>``=2 (a block is
   ``<s>`` text ``</s>``); ``--tokenizer`` loads a saved one, or trains and saves it there.
3. Training: random 512-token windows of the packed training blocks, AdamW, bf16 autocast over fp32 weights,
   warm-up then cosine decay; the step count is set from the first steps' speed to fill ``--train-seconds``. bf16
   copies of the weights after each of the last 65 steps are kept for the stale-weights fault.
4. Engine: the bf16 weights, an own sampling loop over a KV cache (``DynamicCache``, left-padded batches): per token
   the raw logprob log_softmax(logits/T) and the processed one (vLLM's top-k/top-p filter, then log_softmax over
   the kept support, as vLLM's ``processed_logprobs``); sampling by the exponential race, as vLLM.
5. Trainer: a full forward over prompt+completion, right-padded, in micro-batches of ``train_chunk`` rows (not the
   generation batch), log_softmax(logits.float()/T), no filtering: bf16 weights (the engine's), fp32 weights under
   bf16 autocast (TRL with ``bf16=True`` over an fp32 model), or fp32.
6. Faults first (bounded time): ``context_swap`` (the engine generates from another prompt from token 0, the
   trainer scores under the true one), ``late_onset`` (after 80–90 % of a completion the engine continues another
   row's context), ``stale_weights`` (the engine holds the weights of 1, 8 or 64 optimizer steps earlier).
7. Clean steps: the conditions below in turn until the deadline, the token and row targets or the file budget.

The FalconH1 hybrid runs transformers' torch path (no mamba_ssm/causal_conv1d kernels there); its chunked SSD scan,
which materialises (batch, chunk, l, l, heads, head_dim) tensors, is replaced by the same computation written
with einsum (``ssd_chunk_scan``, checked against transformers' at start-up); the recurrent decode step is
transformers' own.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import hashlib
import json
import math
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_schema import PartWriter, round_mantissa, rows_to_table  # noqa: E402

STARTED = time.time()
PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<s>", "</s>"]


def log(message: str) -> None:
    print(f"[{time.time() - STARTED:7.1f}s] {message}", flush=True)


# ----------------------------------------------------------------------------------------------------- corpus
TOP_LEVEL = re.compile(r"^(?:@|def |class |async def )")


def stdlib_files(root: Path) -> list[Path]:
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def split_blocks(text: str) -> list[str]:
    """Top-level blocks of a source file: each def/class (with its decorators) and the code between them."""
    blocks, current, decorated = [], [], False
    for line in text.splitlines(keepends=True):
        if TOP_LEVEL.match(line):
            if not decorated and current:
                blocks.append("".join(current))
                current = []
            decorated = line.startswith("@")
        current.append(line)
    if current:
        blocks.append("".join(current))
    return [b.rstrip() + "\n" for b in blocks if len(b.strip()) >= 20]


def held_out(path: Path, root: Path) -> bool:
    return int(hashlib.sha256(str(path.relative_to(root)).encode()).hexdigest(), 16) % 10 == 0


def corpus(root: Path) -> tuple[list[str], list[str]]:
    train, prompts = [], []
    for path in stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (prompts if held_out(path, root) else train).extend(split_blocks(text))
    return train, prompts


def load_or_train_tokenizer(path: Path | None, texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if path is not None and path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    if [tokenizer.token_to_id(t) for t in SPECIALS] != [PAD, BOS, EOS]:
        raise RuntimeError("tokenizer: special tokens must be <pad>=0 <s>=1 </s>=2")
    if path is not None:
        tokenizer.save(str(path))
    return tokenizer


# ----------------------------------------------------------------------------------------------------- models
def ssd_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                   dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **_):
    """Mamba2's chunked SSD scan (transformers' ``mamba2_chunk_scan`` math) with einsum instead of broadcast sums.

    Shapes: hidden_states (b, L, h, p), dt (b, L, h), A (h,), B and C (b, L, g, n). Returns y (b, L, h, p) in
    float32 and, with ``return_final_states``, the final state (b, h, p, n).
    """
    from transformers.models.falcon_h1.modeling_falcon_h1 import segment_sum

    batch, length, heads, _ = hidden_states.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = hidden_states.float()
    B = B.float().repeat_interleave(heads // B.shape[2], dim=2)
    C = C.float().repeat_interleave(heads // C.shape[2], dim=2)
    pad = (chunk_size - length % chunk_size) % chunk_size

    def chunks(t):
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, -1, chunk_size, *t.shape[2:])

    X, A_dt, B, C = chunks(x * dt[..., None]), chunks(A.float()[None, None] * dt), chunks(B), chunks(C)
    A_dt = A_dt.permute(0, 3, 1, 2)  # b h c l
    A_cumsum = torch.cumsum(A_dt, dim=-1)
    L = torch.exp(segment_sum(A_dt))  # b h c l s
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, X)
    decay_states = torch.exp(A_cumsum[..., -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, X)
    previous = initial_states[:, None].float() if initial_states is not None else torch.zeros_like(states[:, :1])
    states = torch.cat([previous, states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[..., -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    y = (y_diag + y_off).reshape(batch, -1, heads, x.shape[-1])[:, :length].contiguous()
    if D is not None:
        y = y + D.float()[:, None] * x
    return (y, final_state) if return_final_states else y


def patch_falcon_h1_scan(device: str) -> float:
    """Swap transformers' FalconH1 chunk scan for ``ssd_chunk_scan`` after checking both agree; returns max |diff|."""
    from transformers.models.falcon_h1 import modeling_falcon_h1 as m

    original = m.mamba2_chunk_scan
    g = torch.Generator().manual_seed(0)
    b, L, h, p, n, chunk = 2, 45, 4, 8, 16, 16
    args = [torch.randn(b, L, h, p, generator=g), torch.randn(b, L, h, generator=g), -torch.rand(h, generator=g) - 0.5,
            torch.randn(b, L, 1, n, generator=g), torch.randn(b, L, 1, n, generator=g)]
    kwargs = dict(chunk_size=chunk, D=torch.rand(h, generator=g), dt_bias=torch.rand(h, generator=g),
                  initial_states=torch.randn(b, h, p, n, generator=g), dt_softplus=True, return_final_states=True)
    args = [a.to(device) for a in args]
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ref_y, ref_state = original(*args, **kwargs)
    y, state = ssd_chunk_scan(*args, **kwargs)
    diff = max((y - ref_y).abs().max().item(), (state - ref_state).abs().max().item())
    if not diff < 1e-3:
        raise RuntimeError(f"ssd_chunk_scan differs from transformers' mamba2_chunk_scan by {diff}")
    m.mamba2_chunk_scan = ssd_chunk_scan
    return diff


def build_model(arch: str, size: str, vocab_size: int):
    from transformers import AutoModelForCausalLM, FalconH1Config, LlamaConfig

    tiny = size == "tiny"
    common = dict(vocab_size=vocab_size, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
                  max_position_embeddings=1024, hidden_size=64 if tiny else 768, intermediate_size=256 if tiny else 2048,
                  num_attention_heads=2 if tiny else 12, num_key_value_heads=1 if tiny else 4)
    if arch == "llama":
        config = LlamaConfig(num_hidden_layers=2 if tiny else 12, **common)
    elif arch == "falcon_h1":
        config = FalconH1Config(num_hidden_layers=2 if tiny else 8, head_dim=32 if tiny else 64,
                                mamba_d_ssm=128 if tiny else 1536, mamba_n_heads=4 if tiny else 24,
                                mamba_d_head=32 if tiny else 64, mamba_n_groups=1, mamba_d_state=16 if tiny else 64,
                                mamba_d_conv=4, mamba_chunk_size=16 if tiny else 64, **common)
    else:
        raise ValueError(f"--arch {arch!r}: use llama or falcon_h1")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------- training
def train(model, tokens: torch.Tensor, args, device: str):
    """Returns (deque of bf16 parameter snapshots after each of the last 65 steps, training record)."""
    seq, batch = args.seq_len, args.batch_size
    params = [p for p in model.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device == "cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    arange = torch.arange(seq + 1, device=device)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16) if getattr(args, "autocast", True) else contextlib.nullcontext()
    warmup, planned, probe = args.warmup_steps, None, (3, 13)  # time steps 3..13 (after warm-up kernels)
    snapshots: collections.deque = collections.deque(maxlen=65)
    losses, started, step, probe_started = [], time.time(), 0, None
    model.train()
    while planned is None or step < planned:
        if planned is None and step in probe:
            if device == "cuda":
                torch.cuda.synchronize()
            if step == probe[0]:
                probe_started = time.time()
            else:
                per_step = (time.time() - probe_started) / (probe[1] - probe[0])
                planned = max(probe[1] + 5, int((args.train_seconds - (time.time() - started)) / per_step) + step)
                log(f"train: {per_step * 1000:.0f} ms/step over steps {probe[0]}-{probe[1]} -> {planned} steps planned")
        total = planned or 10**9
        lr = args.lr * (min(1.0, (step + 1) / warmup) if step < warmup else
                        0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, tokens.numel() - seq - 1, (batch,), device=device, generator=gen)
        window = tokens[offsets[:, None] + arange].long()
        with autocast:
            logits = model(input_ids=window[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        snapshots.append([p.detach().to(torch.bfloat16, copy=True) for p in params])
        if step % 50 == 0 or step == 1:
            losses.append((step, round(loss.item(), 4)))
            log(f"train step {step}/{planned}: loss {loss.item():.3f} lr {lr:.2e}")
        if time.time() - started > 1.25 * args.train_seconds:
            log(f"train: stopped at step {step} of {planned}, past 1.25 x --train-seconds")
            break
    losses.append((step, round(loss.item(), 4)))
    model.eval()
    return snapshots, {"steps": step, "seconds": round(time.time() - started, 1), "losses": losses,
                       "tokens_seen": step * batch * seq}


def bf16_copy(model, parameters=None):
    engine = copy.deepcopy(model).to(torch.bfloat16).eval()
    if parameters is not None:
        with torch.no_grad():
            for target, source in zip(engine.parameters(), parameters, strict=True):
                target.copy_(source)
    return engine


# ----------------------------------------------------------------------------------------------------- engine
def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p``: mask logits outside the top-k and the top-p nucleus with -inf (ties kept)."""
    if top_k <= 0 and top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k > 0:
        kth = sorted_logits[:, -top_k:-top_k + 1] if top_k > 1 else sorted_logits[:, -1:]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    if top_p < 1.0:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        mask = cumulative <= 1 - top_p
        mask[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(mask, -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@torch.no_grad()
def sample(model, contexts: list[list[int]], temperature: float, top_p: float, top_k: int, max_tokens: list[int] | int,
           device: str, gen: torch.Generator):
    """KV-cache sampling from left-padded contexts. Returns completions, processed and raw logprobs, truncated flags.

    ``max_tokens`` may differ per row (the loop runs to the largest; each row is cut at its own).
    """
    rows = len(contexts)
    limits = torch.tensor([max_tokens] * rows if isinstance(max_tokens, int) else max_tokens, device=device)
    steps = int(limits.max())
    width = max(map(len, contexts))
    ids = torch.full((rows, width), PAD, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    for i, context in enumerate(contexts):
        ids[i, width - len(context):] = torch.tensor(context)
        attention[i, width - len(context):] = 1
    ids, attention = ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    next_position = attention.sum(-1)
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    tokens = torch.full((rows, steps), PAD, dtype=torch.long, device=device)
    processed = torch.zeros((rows, steps), device=device)
    raw = torch.zeros((rows, steps), device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    ran = 0
    for t in range(steps):
        logits = out.logits[:, -1].float() / temperature
        raw_lp = torch.log_softmax(logits, dim=-1)
        proc_lp = raw_lp if (top_k <= 0 and top_p >= 1.0) else torch.log_softmax(top_k_top_p(logits, top_k, top_p), dim=-1)
        race = torch.empty_like(proc_lp).exponential_(generator=gen)
        token = (proc_lp.exp() / race).argmax(dim=-1)
        token = torch.where(done, PAD, token)
        tokens[:, t] = token
        processed[:, t] = proc_lp.gather(-1, token[:, None])[:, 0]
        raw[:, t] = raw_lp.gather(-1, token[:, None])[:, 0]
        done |= (token == EOS) | (t + 1 >= limits)
        ran = t + 1
        if t + 1 == steps or (t % 8 == 7 and bool(done.all())):
            break
        attention = torch.cat([attention, torch.ones((rows, 1), dtype=attention.dtype, device=device)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=attention, position_ids=(next_position + t)[:, None],
                    past_key_values=cache, use_cache=True)
    tokens, processed, raw, limits = tokens[:, :ran].cpu(), processed[:, :ran].cpu(), raw[:, :ran].cpu(), limits.cpu()
    completions, proc_out, raw_out, truncated = [], [], [], []
    for i in range(rows):
        row = tokens[i].tolist()
        limit = int(limits[i])
        length = row.index(EOS) + 1 if EOS in row[:limit] else limit
        completions.append(row[:length])
        proc_out.append(processed[i, :length].tolist())
        raw_out.append(raw[i, :length].tolist())
        truncated.append(EOS not in row[:length])
    return completions, proc_out, raw_out, truncated


# ----------------------------------------------------------------------------------------------------- trainer
@torch.no_grad()
def scored_chunks(model, prompts: list[list[int]], completions: list[list[int]], temperature: float, chunk: int,
                  device: str, autocast: bool = False):
    """Full forwards of prompt+completion, right-padded, ``chunk`` rows at a time: yields each chunk's prompts,
    completions, token ids (rows × width) and float32 logits at the temperature, predicting ids[:, 1:]."""
    context = torch.autocast(device_type=device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    for start in range(0, len(prompts), chunk):
        batch_prompts, batch_completions = prompts[start:start + chunk], completions[start:start + chunk]
        rows = [p + c for p, c in zip(batch_prompts, batch_completions, strict=True)]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            attention[i, :len(row)] = 1
        ids, attention = ids.to(device), attention.to(device)
        with context:
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        yield batch_prompts, batch_completions, ids, logits[:, :-1].float() / temperature


@torch.no_grad()
def score(model, prompts: list[list[int]], completions: list[list[int]], temperature: float, chunk: int, device: str,
          autocast: bool = False) -> list[list[float]]:
    """Trainer logprobs: full forward of prompt+completion, right-padded, ``chunk`` rows at a time, no filtering."""
    out: list[list[float]] = []
    for batch_prompts, batch_completions, ids, logits in scored_chunks(model, prompts, completions, temperature, chunk,
                                                                        device, autocast):
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0].cpu()
        for i, (prompt, completion) in enumerate(zip(batch_prompts, batch_completions, strict=True)):
            out.append(logprobs[i, len(prompt) - 1:len(prompt) - 1 + len(completion)].tolist())
    return out


# ----------------------------------------------------------------------------------------------------- conditions
@dataclass(frozen=True)
class Condition:
    temperature: float
    top_p: float
    top_k: int
    gen_bs: int
    group: int
    prompt_tokens: tuple[int, int]
    train_chunk: int
    trainer: str  # hf-forward-bf16 | hf-forward-fp32-autocast-bf16 | hf-forward-fp32


SAMPLINGS = {"s1": (1.0, 1.0, 0), "s2": (1.0, 0.9, 0), "s3": (0.7, 1.0, 0), "s4": (0.7, 0.9, 0), "s5": (1.0, 1.0, 20),
             "s6": (1.0, 0.8, 0)}
# (generation batch, rollouts per prompt, prompt length range in tokens after <s>, trainer micro-batch)
COMPOSITIONS = {"A": (512, 8, (16, 64), 8), "B": (128, 16, (96, 192), 32), "C": (1024, 8, (8, 192), 64)}
PLAN = [("s1", "A", "hf-forward-bf16"), ("s1", "B", "hf-forward-bf16"), ("s1", "C", "hf-forward-bf16"),
        ("s2", "A", "hf-forward-bf16"), ("s3", "A", "hf-forward-bf16"), ("s4", "A", "hf-forward-bf16"),
        ("s5", "A", "hf-forward-bf16"), ("s6", "A", "hf-forward-bf16"), ("s2", "C", "hf-forward-bf16"),
        ("s1", "A", "hf-forward-fp32-autocast-bf16"), ("s1", "A", "hf-forward-fp32"), ("s2", "B", "hf-forward-fp32-autocast-bf16")]


def conditions(smoke: bool) -> list[Condition]:
    out = []
    for sampling, composition, trainer in PLAN:
        gen_bs, group, prompt_tokens, chunk = COMPOSITIONS[composition]
        if smoke:
            gen_bs, prompt_tokens, chunk = 16, (max(4, prompt_tokens[0] // 4), prompt_tokens[1] // 4), max(2, chunk // 8)
        out.append(Condition(*SAMPLINGS[sampling], gen_bs, group, prompt_tokens, chunk, trainer))
    return out


def condition_name(prefix: str, c: Condition) -> str:
    return (f"{prefix}/T{c.temperature}/top_p{c.top_p}/top_k{c.top_k}/gen_bs{c.gen_bs}/group{c.group}/"
            f"prompt{c.prompt_tokens[0]}-{c.prompt_tokens[1]}/train_chunk{c.train_chunk}/{c.trainer}")


class Prompts:
    """Random openings of held-out stdlib blocks: ``<s>`` + the first k tokens, k in the condition's range."""

    def __init__(self, blocks: list[list[int]], seed: int) -> None:
        self.blocks = blocks
        self.rng = random.Random(seed)

    def draw(self, count: int, lo: int, hi: int) -> list[list[int]]:
        out = []
        while len(out) < count:
            block = self.rng.choice(self.blocks)
            k = self.rng.randint(lo, hi)
            if len(block) >= k + 16:
                out.append([BOS] + block[:k])
        return out


# ----------------------------------------------------------------------------------------------------- rows
def columns(source, condition, model_name, trainer, c_or_sp, step, groups, prompts, completions, engine, raw_lps,
            trainer_lps, truncated, fault="none", fault_starts=None) -> dict:
    temperature, top_p, top_k = c_or_sp
    n = len(completions)
    return {"source": [source] * n, "condition": [condition] * n, "model": [model_name] * n,
            "engine": ["hf-kvcache-bf16"] * n, "trainer": [trainer] * n, "temperature": [temperature] * n,
            "top_p": [top_p] * n, "top_k": [top_k] * n, "step": [step] * n, "group": groups,
            "prompt_len": [len(p) for p in prompts], "completion_ids": completions, "engine_logprobs": engine,
            "trainer_logprobs": trainer_lps, "engine_raw_logprobs": raw_lps, "truncated": truncated, "eos": [EOS] * n,
            "fault": [fault] * n, "fault_start": fault_starts if fault_starts is not None else [-1] * n}


def step_line(table) -> str:
    import numpy as np
    import pyarrow.compute as pc

    flat = {name: pc.list_flatten(table[name]).to_numpy(zero_copy_only=False).astype(np.float64)
            for name in ("engine_logprobs", "engine_raw_logprobs", "trainer_logprobs")}
    parts = []
    for label, name in (("proc", "engine_logprobs"), ("raw", "engine_raw_logprobs")):
        delta = flat["trainer_logprobs"] - flat[name]
        a = np.abs(delta)
        outside = ((delta < math.log(0.9)) | (delta > math.log(1.1))).mean()
        parts.append(f"{label} |Δ| mean {a.mean():.4f} p99 {np.quantile(a, 0.99):.3f} max {a.max():.2f} out {100 * outside:.2f}%")
    return f"rows {table.num_rows} tokens {flat['trainer_logprobs'].size} | " + " | ".join(parts)


# ----------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["llama", "falcon_h1"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=None, help="load this tokenizer.json, or train and save it here")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny model, small batches, short run: a CPU test")
    parser.add_argument("--size", choices=["tiny", "full"], default=None, help="model size (default: tiny with --smoke)")
    parser.add_argument("--source", default=None, help="default h200-llama / h200-hybrid (smoke-<device>-... with --smoke)")
    parser.add_argument("--train-seconds", type=float, default=160.0)
    parser.add_argument("--deadline-seconds", type=float, default=500.0, help="from process start: no new step after")
    parser.add_argument("--fault-seconds", type=float, default=80.0, help="time allowed for the fault batches")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--target-tokens", type=int, default=2_600_000, help="stop once both targets are reached")
    parser.add_argument("--target-rows", type=int, default=10_000)
    parser.add_argument("--part-mib", type=float, default=12.0, help="start a new clean file past this size")
    parser.add_argument("--parts", type=int, default=2, help="clean files at most")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=None, help="training batch (default 64 llama, 32 falcon_h1)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--max-clean-steps", type=int, default=None, help="stop after this many clean steps (tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mantissa-bits", type=int, default=16,
                        help="store logprobs rounded to this many float32 mantissa bits (23 = lossless); see README")
    args = parser.parse_args(argv)
    size = args.size or ("tiny" if args.smoke else "full")
    if args.smoke:
        args.max_tokens = min(args.max_tokens, 24)
        args.seq_len, args.warmup_steps = min(args.seq_len, 64), min(args.warmup_steps, 5)
    args.batch_size = args.batch_size or (4 if args.smoke else 64 if args.arch == "llama" else 32)
    device = args.device
    family = "llama" if args.arch == "llama" else "hybrid"
    source = args.source or (f"smoke-{device}-{family}" if args.smoke else f"h200-{family}")
    torch.manual_seed(args.seed)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 trainer is fp32, not tf32
        log(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")

    import transformers

    log(f"transformers {transformers.__version__}; stdlib {args.stdlib}")
    train_blocks, prompt_blocks = corpus(args.stdlib)
    if args.smoke:
        train_blocks = train_blocks[:1500]
    tokenizer = load_or_train_tokenizer(args.tokenizer, train_blocks, args.vocab_size)
    encode = lambda blocks: [e.ids for e in tokenizer.encode_batch(blocks)]  # noqa: E731
    train_ids, prompt_ids = encode(train_blocks), encode(prompt_blocks)
    flat = [t for ids in train_ids for t in [BOS, *ids, EOS]]
    tokens = torch.tensor(flat, dtype=torch.int32, device=device)
    log(f"corpus: {len(train_blocks)} training blocks ({len(flat)} tokens), {len(prompt_blocks)} held-out blocks")

    if args.arch == "falcon_h1":
        log(f"falcon_h1: einsum SSD scan agrees with transformers' to {patch_falcon_h1_scan(device):.1e}")
    model = build_model(args.arch, size, tokenizer.get_vocab_size()).to(device)
    params = sum(p.numel() for p in model.parameters())
    model_name = f"{args.arch}-{params / 1e6:.0f}M-stdlib" if params >= 1e6 else f"{args.arch}-{params / 1e3:.0f}k-stdlib"
    log(f"model {model_name}: {params} parameters")
    snapshots, record = train(model, tokens, args, device)
    del tokens
    engine = bf16_copy(model)
    log(f"trained: {record}")
    meta = {"source": source, "model": model_name, "parameters": params, "arch": args.arch, "training": record,
            "corpus_blocks": [len(train_blocks), len(prompt_blocks)], "args": {k: str(v) for k, v in vars(args).items()},
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else device}

    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    prompts = Prompts([ids for ids in prompt_ids if len(ids) >= 40], args.seed)
    trainers = {"hf-forward-bf16": (engine, False), "hf-forward-fp32-autocast-bf16": (model, True),
                "hf-forward-fp32": (model, False)}
    prefix = f"{'h200' if device == 'cuda' else device}/{model_name}/bf16"
    stem = f"{source}"
    group_counter = 0

    def new_groups(count: int, per: int) -> list[int]:
        nonlocal group_counter
        groups = [group_counter + g for g in range(count) for _ in range(per)]
        group_counter += count
        return groups

    # ---- faults (bounded)
    fault_writer = PartWriter(args.out, f"{stem}_faults", max_bytes=1 << 40)
    fault_bs, fault_group = (16, 4) if args.smoke else (256, 8)
    fault_plan = [("context_swap", (1.0, 1.0, 0)), ("context_swap", (0.7, 0.9, 0)), ("late_onset", (1.0, 1.0, 0)),
                  ("late_onset", (0.7, 0.9, 0)), ("stale_weights", (1.0, 1.0, 0), 1), ("stale_weights", (1.0, 1.0, 0), 8),
                  ("stale_weights", (1.0, 0.9, 0), 64)]
    fault_started = time.time()
    for fault_step, item in enumerate(fault_plan):
        if time.time() - fault_started > args.fault_seconds:
            log(f"faults: out of time after {fault_step} batches")
            break
        kind, sp = item[0], item[1]
        temperature, top_p, top_k = sp
        count = fault_bs // fault_group if kind != "stale_weights" else fault_bs // fault_group // 2
        true_prompts = prompts.draw(count, 16, 128)
        rows = [p for p in true_prompts for _ in range(fault_group)]
        groups = new_groups(count, fault_group)
        lo = fault_group
        foreign = [true_prompts[(i // fault_group + 1 + (i % max(1, count - 1))) % count] for i in range(len(rows))]
        name = f"{prefix}/T{temperature}/top_p{top_p}/top_k{top_k}/gen_bs{len(rows)}/group{fault_group}/prompt16-128/train_chunk8/hf-forward-bf16/fault={kind}"
        t0 = time.time()
        if kind == "context_swap":
            comps, proc, raw, trunc = sample(engine, foreign, temperature, top_p, top_k, args.max_tokens, device, gen)
            starts = [0] * len(rows)
        elif kind == "stale_weights":
            behind = min(item[2], len(snapshots) - 1)
            name += f"/behind{behind}"
            stale = bf16_copy(model, snapshots[-1 - behind])
            comps, proc, raw, trunc = sample(stale, rows, temperature, top_p, top_k, args.max_tokens, device, gen)
            del stale
            starts = [0] * len(rows)
        else:  # late_onset: clean start, then another row's context for the last 10-20 %
            comps1, proc1, raw1, _ = sample(engine, rows, temperature, top_p, top_k, args.max_tokens, device, gen)
            long_rows = [i for i, c in enumerate(comps1) if len(c) >= max(8, args.max_tokens * 3 // 8)]
            rng = random.Random(args.seed * 7919 + fault_step)
            switch = {i: int(len(comps1[i]) * rng.uniform(0.8, 0.9)) for i in long_rows}
            swapped = {}
            for i in long_rows:
                j = (i + lo * (1 + rng.randrange(max(1, count - 1)))) % len(rows)
                swapped[i] = rows[j] + comps1[j][:switch[i]]
            comps2, proc2, raw2, trunc2 = sample(engine, [swapped[i] for i in long_rows], temperature, top_p, top_k,
                                                 [args.max_tokens - switch[i] for i in long_rows], device, gen)
            keep = long_rows
            rows = [rows[i] for i in keep]
            groups = [groups[i] for i in keep]
            comps = [comps1[i][:switch[i]] + comps2[k] for k, i in enumerate(keep)]
            proc = [proc1[i][:switch[i]] + proc2[k] for k, i in enumerate(keep)]
            raw = [raw1[i][:switch[i]] + raw2[k] for k, i in enumerate(keep)]
            trunc = trunc2
            starts = [switch[i] for i in keep]
        if not rows:
            continue
        trainer_lps = score(engine, rows, comps, temperature, 8, device)
        table = round_mantissa(rows_to_table(columns(source, name, model_name, "hf-forward-bf16", sp, fault_step, groups, rows,
                                                     comps, proc, raw, trainer_lps, trunc, fault=kind, fault_starts=starts)),
                               args.mantissa_bits)
        fault_writer.write(table)
        log(f"fault {kind} {name.split('/fault=')[1]} T{temperature} top_p{top_p}: {step_line(table)} ({time.time() - t0:.1f}s)")
    fault_writer.close()

    # ---- clean steps
    writer = PartWriter(args.out, f"{stem}_clean", max_bytes=int(args.part_mib * (1 << 20)), max_parts=args.parts)
    plan = conditions(args.smoke)
    last_seconds: dict[int, float] = {}
    step = 0
    stop_reason = "plan exhausted"
    while True:
        index = step % len(plan)
        c = plan[index]
        estimate = last_seconds.get(index, 0.0)
        if time.time() - STARTED + 1.2 * estimate > args.deadline_seconds:
            stop_reason = "deadline"
            break
        if writer.tokens >= args.target_tokens and writer.rows >= args.target_rows:
            stop_reason = "targets reached"
            break
        if writer.full:
            stop_reason = "file budget full"
            break
        if step >= (args.max_clean_steps if args.max_clean_steps is not None else len(plan) if args.smoke else 10**9):
            break
        t0 = time.time()
        count = c.gen_bs // c.group
        true_prompts = prompts.draw(count, *c.prompt_tokens)
        rows = [p for p in true_prompts for _ in range(c.group)]
        comps, proc, raw, trunc = sample(engine, rows, c.temperature, c.top_p, c.top_k, args.max_tokens, device, gen)
        t1 = time.time()
        model_for_trainer, autocast = trainers[c.trainer]
        trainer_lps = score(model_for_trainer, rows, comps, c.temperature, c.train_chunk, device, autocast)
        name = condition_name(prefix, c)
        table = round_mantissa(rows_to_table(columns(source, name, model_name, c.trainer, (c.temperature, c.top_p, c.top_k),
                                                     step, new_groups(count, c.group), rows, comps, proc, raw, trainer_lps,
                                                     trunc)), args.mantissa_bits)
        writer.write(table)
        last_seconds[index] = time.time() - t0
        log(f"step {step} [{name.split('/bf16/')[1]}]: {step_line(table)} | gen {t1 - t0:.1f}s score {time.time() - t1:.1f}s "
            f"| total rows {writer.rows} tokens {writer.tokens}")
        step += 1
    writer.close()
    meta.update({"clean_steps": step, "clean_rows": writer.rows, "clean_tokens": writer.tokens, "stop": stop_reason,
                 "fault_rows": fault_writer.rows, "fault_tokens": fault_writer.tokens,
                 "files": [p.name for p in writer.paths + fault_writer.paths], "seconds": round(time.time() - STARTED, 1)})
    (args.out / f"{stem}_meta.json").write_text(json.dumps(meta, indent=1))
    log(f"done ({stop_reason}): {json.dumps({k: meta[k] for k in ('clean_steps', 'clean_rows', 'clean_tokens', 'fault_rows', 'files')})}")


if __name__ == "__main__":
    main()
