"""A tiny character-level model and tokenizer, built and trained locally in seconds.

Tests and the demo need a real model that vLLM and TRL can both load, without downloading weights. A randomly
initialised model barely looks at its prompt, so swapping the prompt (the way stale engine state does) would
hardly change its log-probabilities. This one is trained for a few seconds on a copy task (``abc=`` -> ``abc``),
so it conditions strongly on the prompt: generation under another context gives confident text that the
trainer, reading the true prompt, finds very unlikely — the signature the guard must catch.

The result is cached under ``cache_dir`` keyed by the recipe, so a second call returns at once.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
ALPHABET = string.ascii_lowercase + "="
PAD, BOS, EOS, UNK = SPECIAL_TOKENS


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything that determines the built model; its hash names the cache folder."""

    architecture: str = "llama"  # "llama", "falcon_h1" (hybrid attention + Mamba2, like the AI21 case) or "mamba2"
    hidden_size: int = 64  # vLLM's CPU attention needs head_dim in {32, 64, 80, ...}: 64 / 2 heads = 32
    num_layers: int = 2
    num_heads: int = 2
    min_letters: int = 3
    max_letters: int = 8
    train_steps: int = 400
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 0
    version: int = 1  # bump when the builder changes in a way the fields above do not show

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


MAMBA2_RECIPE = TinyModelRecipe(architecture="mamba2", train_steps=800)
"""A pure Mamba2 copy model (60k parameters). 800 steps (~6 min on 2 busy cores; transformers has no fast Mamba2
kernel on CPU) take the completion loss to ~0.02 nats/token, so outputs are peaked and follow the prompt."""


def copy_prompt(letters: str) -> str:
    return f"{letters}="


def copy_reward(prompt: str, completion: str) -> float:
    """Share of the prompt's letters reproduced at the right position (1.0 = exact copy)."""
    target = prompt.rstrip("=")
    hits = sum(a == b for a, b in zip(target, completion, strict=False))
    return hits / max(len(target), len(completion), 1)


def random_letters(rng: random.Random, recipe: TinyModelRecipe) -> str:
    length = rng.randint(recipe.min_letters, recipe.max_letters)
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def _model_config(recipe: TinyModelRecipe, vocab_size: int, tokenizer):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    if recipe.architecture == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(intermediate_size=4 * recipe.hidden_size, **common)
    if recipe.architecture == "falcon_h1":
        from transformers import FalconH1Config

        return FalconH1Config(
            intermediate_size=4 * recipe.hidden_size,
            head_dim=recipe.hidden_size // recipe.num_heads,
            mamba_d_ssm=recipe.hidden_size,
            mamba_n_heads=4,
            mamba_d_head=recipe.hidden_size // 4,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_chunk_size=64,
            **common,
        )
    if recipe.architecture == "mamba2":
        from transformers import Mamba2Config

        # Pure Mamba2 (no attention). Inner width expand * hidden_size is split into heads of hidden_size //
        # num_heads channels (32 by default, as the attention models' head_dim); vLLM CPU runs it in bfloat16 only.
        head_dim = recipe.hidden_size // recipe.num_heads
        return Mamba2Config(
            vocab_size=vocab_size,
            hidden_size=recipe.hidden_size,
            num_hidden_layers=recipe.num_layers,
            expand=2,
            head_dim=head_dim,
            num_heads=2 * recipe.hidden_size // head_dim,
            n_groups=1,
            state_size=16,
            conv_kernel=4,
            chunk_size=8,  # transformers' reference scan (no mamba_ssm on CPU) pads to a chunk: 64 is 8x slower
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
            dtype="float32",
        )
    raise ValueError(f"TinyModelRecipe.architecture={recipe.architecture!r}: use 'llama', 'falcon_h1' or 'mamba2'")


def _training_batch(rng: random.Random, recipe: TinyModelRecipe, tokenizer):
    """Left-aligned copy examples; the loss sees only the completion (letters after '=' and EOS)."""
    rows, loss_rows = [], []
    for _ in range(recipe.batch_size):
        letters = random_letters(rng, recipe)
        prompt = tokenizer(copy_prompt(letters), add_special_tokens=False)["input_ids"]
        completion = tokenizer(letters, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + completion)
        loss_rows.append([0] * len(prompt) + [1] * len(completion))
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, loss_row) in enumerate(zip(rows, loss_rows, strict=True)):
        ids = torch.tensor(row)
        input_ids[i, : len(row)] = ids
        attention[i, : len(row)] = 1
        labels[i, : len(row)] = torch.where(torch.tensor(loss_row, dtype=torch.bool), ids, -100)
    return input_ids, attention, labels


def build_tiny_model(cache_dir: str | Path, recipe: TinyModelRecipe | None = None) -> Path:
    """Build (or reuse) the tiny model + tokenizer; returns the folder that vLLM and transformers load."""
    from transformers import AutoModelForCausalLM

    recipe = recipe or TinyModelRecipe()
    target = Path(cache_dir) / f"tiny-copy-{recipe.architecture}-{recipe.digest()}"
    if (target / "recipe.json").exists():
        return target

    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    tokenizer = build_tokenizer()
    config = _model_config(recipe, len(tokenizer), tokenizer)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
    model.train()
    for _ in range(recipe.train_steps):
        input_ids, attention, labels = _training_batch(rng, recipe, tokenizer)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()

    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    (partial / "recipe.json").write_text(json.dumps({**asdict(recipe), "final_loss": loss.item()}, indent=2))
    partial.rename(target)
    return target
