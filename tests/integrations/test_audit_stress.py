"""rollout-guard audit --stress on real vLLM CPU, with the engine-level stale-state fault of vLLM PR #32118
reinstated (rollout_guard/testing/engine_faults.py, FAULT INJECTION FOR TESTS) and without it; replay names the patterns.

The fault runs through ``python -m rollout_guard.testing.engine_faults``: the same command line with the fault
switched on in its process. Ground truth is the transformers re-scoring of every rollout (the audit's own).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_guard.testing.tiny_model import TinyModelRecipe, build_tiny_model, copy_prompt, random_letters
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.outputs.store import read_records

CLEAN_NOISE = 0.5  # nats: bf16 engine vs fp32 transformers on clean Mamba2 rollouts (0.24–0.44 seen)
STRESS = ["--stress", "--dtype", "bfloat16", "--trainer-dtype", "float32", "--max-tokens", "12", "--rounds", "2"]



def first_divergent(record: QuarantineRecord, nats: float = 1.0) -> int:
    """The first completion token whose |engine − trainer| exceeds ``nats`` in a record's own logprobs (−1: none)."""
    pairs = zip(record.engine_logprobs or [], record.trainer_logprobs or [], strict=False)
    return next((i for i, (e, t) in enumerate(pairs) if e is not None and t is not None and abs(e - t) > nats), -1)

def cli(*args: str, fault: bool = False, timeout: int = 900) -> subprocess.CompletedProcess:
    module = "rollout_guard.testing.engine_faults" if fault else "rollout_guard.cli"
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)


def explain(done: subprocess.CompletedProcess) -> str:
    return done.stdout[-4000:] + done.stderr[-4000:]


def metrics_of(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


@pytest.fixture(scope="module")
def copy_prompts(tmp_path_factory) -> Path:
    rng = random.Random(5)
    path = tmp_path_factory.mktemp("prompts") / "copy.txt"
    path.write_text("\n".join(copy_prompt(random_letters(rng, TinyModelRecipe())) for _ in range(16)) + "\n")
    return path


@pytest.fixture(scope="module")
def with_fault(tmp_path_factory, mamba2_dir, copy_prompts) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("fault_on")
    return cli("audit", str(mamba2_dir), "--prompts", str(copy_prompts), *STRESS, "-o", str(out), fault=True), out


def test_stale_state_fault_makes_audit_stress_exit_1_and_list_the_samples(with_fault):
    done, out = with_fault
    assert done.returncode == 1, explain(done)
    assert "conditions: token budget per step (--max-num-batched-tokens): 8" in done.stdout
    assert "DISAGREES" in done.stdout and "suspect sample" in done.stdout
    fired = int(done.stderr.split("fault fired: ")[1].split()[0])
    records = list(read_records(out / "quarantine"))
    assert fired > 0 and records, explain(done)
    # no suspect sample within clean bf16 noise of transformers; the fault's signature is there: a sample off by more
    # than 8 nats from its first token (the stale state is read at token 0). How many samples the fault corrupts,
    # and how strongly, depends on the engine's scheduling and the CPU's kernels.
    assert all(record.stats["max_abs_delta"] > CLEAN_NOISE for record in records)
    assert any(record.stats["max_abs_delta"] > 8.0 and first_divergent(record) == 0 for record in records)


def test_shipped_engine_agrees_on_the_same_prompts_and_stress(tmp_path, mamba2_dir, copy_prompts):
    done = cli("audit", str(mamba2_dir), "--prompts", str(copy_prompts), *STRESS, "-o", str(tmp_path))
    assert done.returncode == 0, explain(done)
    assert "verdict: agrees" in done.stdout
    metrics = metrics_of(tmp_path)
    assert metrics["samples"] == 16 * 4 * 2 and metrics["suspect"] == 0


def test_llama_audit_stress_splits_prompts_across_steps_and_agrees(tmp_path, tiny_model_dir):
    """Prompts longer than the 8-token budget are split across engine steps: with a per-request seed the CPU build
    raised 'CPU Generator does not use offset' there. Exit 0: the Llama-style engine agrees under stress."""
    rng = random.Random(3)
    prompts = tmp_path / "long.txt"
    prompts.write_text("\n".join(copy_prompt(random_letters(rng, TinyModelRecipe(min_letters=8, max_letters=8)) * 2)
                               for _ in range(12)) + "\n")  # 17-token prompts
    done = cli("audit", str(tiny_model_dir), "--prompts", str(prompts), "--stress", "--dtype", "bfloat16",
               "--max-tokens", "12", "--rounds", "1", "-o", str(tmp_path / "out"))
    assert done.returncode == 0, explain(done)
    assert "verdict: agrees" in done.stdout and metrics_of(tmp_path / "out")["samples"] == 48


def edited(record: QuarantineRecord, engine: list[float], trainer: list[float] | None = None) -> QuarantineRecord:
    data = record.to_json_dict()
    data["engine_logprobs"] = engine
    if trainer is not None:
        data["trainer_logprobs"] = trainer
    return QuarantineRecord.from_json_dict(data)


def test_replay_names_the_patterns(tmp_path, with_fault):
    """Real stale-state records, and records edited from them into the other shapes, through one `replay --all`."""
    _, out = with_fault
    records = list(read_records(out / "quarantine"))
    from_start = [r for r in records if first_divergent(r) == 0]
    assert from_start, "no sample corrupted from token 0: the fault left no stale-state record to replay"

    def high_share(record: QuarantineRecord) -> float:
        high = [abs(e - t) > 2.0 for e, t in zip(record.engine_logprobs, record.trainer_logprobs, strict=True)]
        return sum(high) / max(len(high), 1)

    real = max(from_start, key=lambda r: (high_share(r), len(r.completion_ids)))  # the most strongly corrupted
    base = max(records, key=lambda r: len(r.completion_ids))  # the edited shapes need room: the longest completion
    n = len(base.completion_ids)
    assert n >= 4
    trainer = [float(v) for v in base.trainer_logprobs]  # the true prompt's logprobs of these tokens (fp32)

    def shifted(indices) -> list[float]:
        return [t + 9.0 if i in indices and t + 9.0 <= 0 else (t - 9.0 if i in indices else t) for i, t in enumerate(trainer)]

    cases = {
        "divergent from start": real,
        "isolated spikes": edited(base, shifted({1})),
        "late onset": edited(base, shifted(set(range(n - 2, n)))),
        "not reproducible": edited(base, trainer, trainer=[t - 9.0 for t in trainer]),
    }
    store = tmp_path / "store.jsonl"
    store.write_text("".join(json.dumps(r.to_json_dict()) + "\n" for r in cases.values()))
    done = cli("replay", str(store), "--all", "--dtype", "bfloat16")
    assert done.returncode == 0, explain(done)
    lines = [line for line in done.stdout.splitlines() if "pattern:" in line]
    assert len(lines) == len(cases), explain(done)
    for line, expected in zip(lines, cases, strict=True):
        assert f"pattern: {expected} " in line, (expected, line)


def test_replay_names_every_token_when_a_fresh_engine_with_the_engine_weights_reproduces_it(tmp_path, tiny_model_dir):
    """The engine ran other weights (a failed weight sync): a fresh engine with those weights reproduces the
    disagreement on every token, while the trainer's weights copy the prompt."""
    from transformers import AutoTokenizer

    untrained = build_tiny_model(tiny_model_dir.parent, TinyModelRecipe(train_steps=1, seed=1))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer("hello=", add_special_tokens=False)["input_ids"]
    completion = tokenizer("hello", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    record = QuarantineRecord(
        step=3, process_index=0, row=0, global_row=0, group_size=1, action="quarantined", rules=["score"], stats={},
        prompt_ids=prompt, completion_ids=completion, prompt_text="hello=", completion_text="hello</s>",
        completion_tokens=[tokenizer.decode([t]) for t in completion], engine_logprobs=[-3.4] * len(completion),
        trainer_logprobs=[-0.01] * len(completion), reward=None, rewards_per_func={}, advantage_before=None,
        advantage_after=None, sampling={"temperature": 1.0}, model=str(tiny_model_dir), engine={"name": "vllm"},
    )
    store = tmp_path / "store.jsonl"
    store.write_text(json.dumps(record.to_json_dict()) + "\n")
    done = cli("replay", str(store), "--engine-model", str(untrained))
    assert done.returncode == 0, explain(done)
    assert "pattern: every token" in done.stdout and "weights or dtype" in done.stdout, explain(done)
    assert "conclusion: the disagreement reproduces from the prompt alone" in done.stdout
