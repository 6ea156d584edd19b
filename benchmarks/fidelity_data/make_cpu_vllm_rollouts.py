"""Clean (and a few faulty) rollouts from the vLLM CPU build in bf16, scored by transformers in fp32 and bf16.

    python benchmarks/fidelity_data/make_cpu_vllm_rollouts.py --out benchmarks/fidelity_data   # ~10 min on 2 cores

Models (each engine runs in its own subprocess: one vLLM engine per process on the CPU build):

* ``copy-llama``, ``copy-falcon_h1``: the project's tiny copy models (``rollout_guard/testing/tiny_model.py``; FalconH1 = attention
  + Mamba2), prompts ``letters=``, completions the copied letters and ``</s>``.
* ``stdlib-llama``: a tiny Llama (hidden 64, 2 layers, the 8k stdlib BPE) trained here for ``--train-seconds`` in fp32
  on this Python's standard library (``make_h200_rollouts.py``'s corpus and trainer); prompts are openings of
  held-out blocks. Its weights 8 and 64 optimizer steps before the end are saved too and serve as stale engines.

Engine: ``vllm.LLM(dtype="bfloat16", enforce_eager=True, logprobs_mode="processed_logprobs")``, no per-request seed,
prefix caching off. ``engine_logprobs`` are vLLM's returned logprobs of the sampled tokens (after temperature and
top-k/top-p, renormalised). ``engine_raw_logprobs`` come from the same engine, teacher-forced: prompt+completion as a
prompt with ``prompt_logprobs`` (vLLM computes them from the unprocessed logits of a prefill): at T=1 the sampled
token's logprob; at T≠1 the whole distribution (``prompt_logprobs=-1``, only for the 31-token copy models), from which
log_softmax(logits/T) follows exactly. So on these rows the raw logprobs come from the engine's prefill, not from its
decode step. Trainer: ``AutoModelForCausalLM`` full forward, right-padded, in fp32 or bf16, micro-batch ``train_chunk``.

Faults (real vLLM engine): ``context_swap`` (vLLM generates from another row's prompt), ``late_onset`` (vLLM continues
another row's context for the last 10-20 % of a completion), ``stale_weights`` (stdlib-llama only: the engine holds
the weights of 8 or 64 optimizer steps earlier; the trainer the final ones).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: rollout_guard.testing.tiny_model

STARTED = time.time()


def log(message: str) -> None:
    print(f"[{time.time() - STARTED:7.1f}s] {message}", flush=True)


# ------------------------------------------------------------------------------------------------ models
def build_copy_model(cache: Path, architecture: str) -> Path:
    try:
        from rollout_guard.testing.tiny_model import TinyModelRecipe, build_tiny_model
    except ImportError:  # a worktree without the integrations symlink
        sys.path.insert(0, str(HERE.parents[1] / "integrations"))
        from tiny_model import TinyModelRecipe, build_tiny_model
    if architecture == "falcon_h1":  # transformers' reference SSD scan took > 40 min here; same math with einsum
        import make_h200_rollouts as gpu

        gpu.patch_falcon_h1_scan("cpu")
    return build_tiny_model(cache, TinyModelRecipe(architecture=architecture))


def build_stdlib_llama(cache: Path, tokenizer_path: Path, train_seconds: float, seed: int) -> dict[str, Path]:
    """Train the tiny stdlib Llama in fp32 here; save the final weights and those 8 and 64 steps earlier."""
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    import make_h200_rollouts as gpu

    target = cache / f"stdlib-llama-tiny-{int(train_seconds)}s-seed{seed}"
    folders = {name: target / name for name in ("final", "behind8", "behind64")}
    if all((f / "config.json").exists() for f in folders.values()):
        return folders
    torch.manual_seed(seed)
    train_blocks, _ = gpu.corpus(gpu.Path(gpu.sysconfig.get_paths()["stdlib"]))
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids = [e.ids for e in tokenizer.encode_batch(train_blocks[:3000])]
    tokens = torch.tensor([t for row in ids for t in [gpu.BOS, *row, gpu.EOS]], dtype=torch.int32)
    model = gpu.build_model("llama", "tiny", tokenizer.get_vocab_size())
    args = argparse.Namespace(seq_len=128, batch_size=16, lr=3e-3, seed=seed, warmup_steps=20, train_seconds=train_seconds,
                              autocast=False)
    snapshots, record = gpu.train(model, tokens, args, "cpu")
    log(f"stdlib-llama trained: {record['steps']} steps, loss {record['losses'][-1][1]}")
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    for name, behind in (("final", 0), ("behind8", 8), ("behind64", 64)):
        behind = min(behind, len(snapshots) - 1)
        copy = gpu.copy.deepcopy(model)
        with torch.no_grad():
            for p, s in zip(copy.parameters(), snapshots[-1 - behind], strict=True):
                p.copy_(s.float())
        folder = folders[name]
        folder.mkdir(parents=True, exist_ok=True)
        copy.save_pretrained(folder, safe_serialization=True)
        hf_tokenizer.save_pretrained(folder)
        (folder / "training.json").write_text(json.dumps({**record, "behind": behind}))
    return folders


# ------------------------------------------------------------------------------------------------ worker
def teacher_forced_raw(llm, prompts, completions, temperature: float, full_vocab: bool) -> list[list[float]]:
    """The engine's logprob of each completion token from a prefill over prompt+completion, at temperature T."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=-1 if full_vocab else 0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, completions, strict=True)], params,
                           use_tqdm=False)
    result = []
    for output, prompt, completion in zip(outputs, prompts, completions, strict=True):
        entries = output.prompt_logprobs[len(prompt):len(prompt) + len(completion)]
        row = []
        for token, entry in zip(completion, entries, strict=True):
            if full_vocab:
                values = {t: lp.logprob for t, lp in entry.items()}
                scaled = {t: v / temperature for t, v in values.items()}
                top = max(scaled.values())
                norm = top + math.log(sum(math.exp(v - top) for v in scaled.values()))
                row.append(scaled[token] - norm)
            else:
                row.append(entry[token].logprob)
        result.append(row)
    return result


def worker(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    import make_h200_rollouts as gpu
    from rollout_schema import PartWriter, rows_to_table

    spec = json.loads(args.worker)
    rng = random.Random(spec["seed"])
    llm = LLM(model=spec["engine_model"], dtype="bfloat16", enforce_eager=True, logprobs_mode="processed_logprobs",
              max_logprobs=-1, max_model_len=spec["max_model_len"], seed=spec["seed"], enable_prefix_caching=False)
    import vllm

    engine_name = f"vllm-cpu-{vllm.__version__.rsplit('.', 1)[0]}-bf16"
    trainer32 = AutoModelForCausalLM.from_pretrained(spec["trainer_model"], dtype=torch.float32).eval()
    trainer16 = AutoModelForCausalLM.from_pretrained(spec["trainer_model"], dtype=torch.bfloat16).eval()
    trainers = {"hf-forward-fp32": trainer32, "hf-forward-bf16": trainer16}
    vocab = trainer32.config.vocab_size
    log(f"{spec['source']}: engine {spec['engine_model']} ({engine_name}), trainer {spec['trainer_model']}, vocab {vocab}")

    if spec["prompts"] == "copy":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec["trainer_model"])

        def draw(count: int) -> list[list[int]]:
            out = []
            for _ in range(count):
                letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
                out.append(tokenizer(f"{letters}=", add_special_tokens=False)["input_ids"])
            return out
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(HERE / "stdlib_bpe8k.json"))
        _, prompt_blocks = gpu.corpus(gpu.Path(gpu.sysconfig.get_paths()["stdlib"]))
        pool = gpu.Prompts([e.ids for e in tok.encode_batch(prompt_blocks) if len(e.ids) >= 40], spec["seed"])

        def draw(count: int) -> list[list[int]]:
            return pool.draw(count, 16, 64)

    writer = PartWriter(spec["out"], spec["stem"], max_bytes=1 << 40)
    group_counter = spec.get("group_offset", 0)  # unique group ids and steps within a source across workers
    max_tokens = spec["max_tokens"]

    def generate(contexts, temperature, top_p, top_k, limits):
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=limit, logprobs=0,
                                 detokenize=False) for limit in limits]
        outputs = llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
        completions, logprobs, truncated = [], [], []
        for output in outputs:
            sample = output.outputs[0]
            completions.append(list(sample.token_ids))
            logprobs.append([entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs, strict=True)])
            truncated.append(sample.finish_reason == "length")
        return completions, logprobs, truncated

    def emit(step, condition, sampling, trainer, chunk, rows, groups, completions, engine_lps, truncated, fault, starts,
             raw=None):
        temperature = sampling[0]
        if raw is None:  # the engine's own context is the true prompt (clean rows, stale weights)
            raw = teacher_forced_raw(llm, rows, completions, temperature, full_vocab=temperature != 1.0)
        trainer_lps = gpu.score(trainers[trainer], rows, completions, temperature, chunk, "cpu")
        n = len(rows)
        table = rows_to_table({
            "source": [spec["source"]] * n, "condition": [condition] * n, "model": [spec["model"]] * n,
            "engine": [engine_name] * n, "trainer": [trainer] * n, "temperature": [sampling[0]] * n,
            "top_p": [sampling[1]] * n, "top_k": [sampling[2]] * n, "step": [step] * n, "group": groups,
            "prompt_len": [len(r) for r in rows], "completion_ids": completions, "engine_logprobs": engine_lps,
            "trainer_logprobs": trainer_lps, "engine_raw_logprobs": raw, "truncated": truncated,
            "eos": [spec["eos"]] * n, "fault": [fault] * n, "fault_start": starts})
        writer.write(table)
        log(f"{spec['source']} step {step} {fault} [{condition.split('/vllm-bf16/')[1]}]: {gpu.step_line(table)}")

    prefix = f"cpu/{spec['model']}/vllm-bf16"
    per = spec["group"]
    step = spec.get("step_offset", 0)
    for kind, sampling in spec["faults"]:
        count = spec["gen_bs"] // per
        prompts = draw(count)
        rows = [p for p in prompts for _ in range(per)]
        groups = [group_counter + i // per for i in range(len(rows))]
        group_counter += count
        name = f"{prefix}/T{sampling[0]}/top_p{sampling[1]}/top_k{sampling[2]}/gen_bs{len(rows)}/group{per}/train_chunk8/hf-forward-fp32/fault={kind}"
        if kind == "context_swap":
            foreign = [prompts[(i // per + 1 + rng.randrange(count - 1)) % count] for i in range(len(rows))]
            comps, lps, trunc = generate(foreign, *sampling, [max_tokens] * len(rows))
            raw = teacher_forced_raw(llm, foreign, comps, sampling[0], full_vocab=sampling[0] != 1.0)
            starts = [0] * len(rows)
        elif kind == "stale_weights":
            name += f"/{spec['stale_label']}"
            comps, lps, trunc = generate(rows, *sampling, [max_tokens] * len(rows))
            raw = None
            starts = [0] * len(rows)
        else:  # late_onset
            comps1, lps1, _ = generate(rows, *sampling, [max_tokens] * len(rows))
            keep = [i for i, c in enumerate(comps1) if len(c) >= spec["late_min_len"]]
            switch = {i: max(1, int(len(comps1[i]) * rng.uniform(0.8, 0.9))) for i in keep}
            other = {i: (i + per * (1 + rng.randrange(count - 1))) % len(rows) for i in keep}
            contexts = [rows[other[i]] + comps1[other[i]][:switch[i]] for i in keep]
            comps2, lps2, trunc = generate(contexts, *sampling, [max_tokens - switch[i] for i in keep])
            raw1 = teacher_forced_raw(llm, [rows[i] for i in keep], [comps1[i][:switch[i]] for i in keep], sampling[0],
                                      full_vocab=sampling[0] != 1.0)
            raw2 = teacher_forced_raw(llm, contexts, comps2, sampling[0], full_vocab=sampling[0] != 1.0)
            raw = [a + b for a, b in zip(raw1, raw2, strict=True)]  # each part under the context the engine had
            rows, groups = [rows[i] for i in keep], [groups[i] for i in keep]
            comps = [comps1[i][:switch[i]] + comps2[k] for k, i in enumerate(keep)]
            lps = [lps1[i][:switch[i]] + lps2[k] for k, i in enumerate(keep)]
            starts = [switch[i] for i in keep]
        if rows:
            emit(step, name, sampling, "hf-forward-fp32", 8, rows, groups, comps, lps, trunc, kind, starts, raw)
        step += 1
    for cond in spec["conditions"]:
        sampling, trainer, chunk, steps = tuple(cond["sampling"]), cond["trainer"], cond["chunk"], cond["steps"]
        for _ in range(steps):
            count = spec["gen_bs"] // per
            prompts = draw(count)
            rows = [p for p in prompts for _ in range(per)]
            groups = [group_counter + i // per for i in range(len(rows))]
            group_counter += count
            comps, lps, trunc = generate(rows, *sampling, [max_tokens] * len(rows))
            name = (f"{prefix}/T{sampling[0]}/top_p{sampling[1]}/top_k{sampling[2]}/gen_bs{len(rows)}/group{per}/"
                    f"train_chunk{chunk}/{trainer}")
            emit(step, name, sampling, trainer, chunk, rows, groups, comps, lps, trunc, "none", [-1] * len(rows))
            step += 1
    writer.close()
    log(f"{spec['source']}: {writer.rows} rows, {writer.tokens} tokens -> {[p.name for p in writer.paths]}")


# ------------------------------------------------------------------------------------------------ main
def conditions(top_k: int, small_vocab: bool, steps: int) -> list[dict]:
    out = [{"sampling": [1.0, 1.0, 0], "trainer": "hf-forward-fp32", "chunk": 8, "steps": steps},
           {"sampling": [1.0, 1.0, 0], "trainer": "hf-forward-bf16", "chunk": 8, "steps": steps},
           {"sampling": [1.0, 1.0, 0], "trainer": "hf-forward-fp32", "chunk": 32, "steps": steps},
           {"sampling": [1.0, 0.9, 0], "trainer": "hf-forward-fp32", "chunk": 8, "steps": steps},
           {"sampling": [1.0, 1.0, top_k], "trainer": "hf-forward-fp32", "chunk": 8, "steps": steps}]
    if small_vocab:  # T != 1 needs the whole distribution for the raw column (31 tokens here)
        out.append({"sampling": [0.7, 1.0, 0], "trainer": "hf-forward-fp32", "chunk": 8, "steps": steps})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, default=HERE.parents[1] / ".cache" / "fidelity_models")
    parser.add_argument("--models", nargs="+", default=["copy-llama", "copy-falcon_h1", "stdlib-llama"])
    parser.add_argument("--train-seconds", type=float, default=120.0, help="training time of the stdlib tiny Llama")
    parser.add_argument("--steps", type=int, default=3, help="steps per clean condition")
    parser.add_argument("--gen-bs", type=int, default=128, help="rollouts per step (copy models); stdlib-llama: half")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(args.cache / "vllm"))
    specs = []
    common = {"out": str(args.out), "seed": args.seed}
    for name in args.models:
        if name.startswith("copy-"):
            arch = name.split("-", 1)[1]
            folder = build_copy_model(args.cache, arch)
            specs.append({**common, "source": f"cpu-vllm-{name}", "model": f"tiny-copy-{arch}", "engine_model": str(folder),
                          "trainer_model": str(folder), "stem": f"cpu-vllm-{name}", "prompts": "copy", "max_model_len": 64,
                          "max_tokens": 16, "gen_bs": args.gen_bs, "group": 8, "eos": 2, "late_min_len": 5,
                          "conditions": conditions(5, True, args.steps),
                          "faults": [["context_swap", [1.0, 1.0, 0]], ["late_onset", [1.0, 1.0, 0]]]})
        elif name == "stdlib-llama":
            folders = build_stdlib_llama(args.cache, HERE / "stdlib_bpe8k.json", args.train_seconds, args.seed)
            log(f"stdlib-llama folders: {folders['final'].parent}")
            base = {**common, "source": "cpu-vllm-stdlib-llama", "model": f"tiny-stdlib-llama-{int(args.train_seconds)}s",
                    "trainer_model": str(folders["final"]), "prompts": "stdlib", "max_model_len": 256, "max_tokens": 96,
                    "gen_bs": args.gen_bs // 2, "group": 8, "eos": 2, "late_min_len": 32}
            specs.append({**base, "engine_model": str(folders["final"]), "stem": "cpu-vllm-stdlib-llama",
                          "conditions": conditions(20, False, args.steps),
                          "faults": [["context_swap", [1.0, 1.0, 0]], ["late_onset", [1.0, 1.0, 0]]]})
            for k, behind in enumerate(("behind8", "behind64"), start=1):
                label = "behind{}".format(json.loads((folders[behind] / "training.json").read_text())["behind"])  # <= 64
                specs.append({**base, "engine_model": str(folders[behind]), "stem": f"cpu-vllm-stdlib-llama-stale-{label}",
                              "stale_label": label, "step_offset": 1000 * k, "group_offset": 100_000 * k, "conditions": [], "faults": [["stale_weights", [1.0, 1.0, 0]]] * 2})
        else:
            raise SystemExit(f"--models {name!r}: use copy-llama, copy-falcon_h1, stdlib-llama")
    for spec in specs:
        log(f"worker {spec['stem']}")
        result = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--worker", json.dumps(spec)],
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
        if result.returncode != 0:
            raise SystemExit(f"worker {spec['stem']} failed with exit code {result.returncode}")
    log("done")


if __name__ == "__main__":
    main()
