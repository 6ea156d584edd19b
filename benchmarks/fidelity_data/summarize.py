"""Per-condition and per-step |engine - trainer| figures of rollout files, beside the published ones.

    python benchmarks/fidelity_data/summarize.py benchmarks/fidelity_data/*.parquet --json s.json --md s.md

For each (source, condition) and each step: rows, tokens, truncated share, mean / p99 / max |Δ| with
Δ = engine − trainer (processed engine logprobs, then the engine's raw logprobs), and the share of tokens whose
probability ratio π_trainer / π_engine lies outside [0.9, 1.1] (TRL #6789 / #7269's measure).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import load_rollouts  # noqa: E402

PUBLISHED = (
    "Published (7B, healthy): dense per-step mean |Δ| 0.06–0.11 nats, per-step max 10.6–13.2; hybrid mean 0.24–0.58, "
    "max ≈ 18 (allenai/open-instruct docs/hybrid-rl-logprobs.md). Ratio outside [0.9, 1.1]: 7.5 % of tokens in bf16 at "
    "top_p=1 (TRL #6789), 51.8 % at top_p=0.8 (TRL #7269)."
)
LOW, HIGH = math.log(0.9), math.log(1.1)


def token_stats(engine: np.ndarray, trainer: np.ndarray) -> dict[str, float]:
    """mean / p99 / max |engine − trainer| and the share of tokens with exp(trainer − engine) outside [0.9, 1.1].

    >>> s = token_stats(np.array([-1.0, -2.0, -0.5]), np.array([-1.0, -2.5, -0.5]))
    >>> round(s["mean"], 4), s["max"], round(s["outside"], 4)
    (0.1667, 0.5, 0.3333)
    """
    delta = trainer.astype(np.float64) - engine.astype(np.float64)
    finite = np.isfinite(delta)
    delta = delta[finite]
    if delta.size == 0:
        return {"mean": math.nan, "p99": math.nan, "max": math.nan, "outside": math.nan, "nonfinite": int((~finite).sum())}
    absolute = np.abs(delta)
    return {"mean": float(absolute.mean()), "p99": float(np.quantile(absolute, 0.99)), "max": float(absolute.max()),
            "outside": float(((delta < LOW) | (delta > HIGH)).mean()), "nonfinite": int((~finite).sum())}


def _flat(table: pa.Table, name: str) -> np.ndarray:
    return pc.list_flatten(table[name]).to_numpy(zero_copy_only=False)


def summarize(table: pa.Table) -> list[dict]:
    """One entry per (source, condition, fault): pooled token stats, the per-step list, per-step mean/max ranges."""
    out = []
    keys = table.select(["source", "condition", "fault"]).to_pylist()
    index: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        index.setdefault((key["source"], key["condition"], key["fault"]), []).append(i)
    for (source, condition, fault), rows in sorted(index.items()):
        part = table.take(pa.array(rows))
        steps = part["step"].to_numpy()
        entry = {"source": source, "condition": condition, "fault": fault, "rows": part.num_rows,
                 "tokens": int(pc.sum(pc.list_value_length(part["completion_ids"])).as_py()),
                 "truncated": float(pc.mean(part["truncated"].cast(pa.float64())).as_py()),
                 "processed": token_stats(_flat(part, "engine_logprobs"), _flat(part, "trainer_logprobs")),
                 "raw": token_stats(_flat(part, "engine_raw_logprobs"), _flat(part, "trainer_logprobs")), "steps": []}
        for step in np.unique(steps):
            sub = part.filter(pc.equal(part["step"], int(step)))
            entry["steps"].append({"step": int(step), "rows": sub.num_rows,
                                   "tokens": int(pc.sum(pc.list_value_length(sub["completion_ids"])).as_py()),
                                   "processed": token_stats(_flat(sub, "engine_logprobs"), _flat(sub, "trainer_logprobs")),
                                   "raw": token_stats(_flat(sub, "engine_raw_logprobs"), _flat(sub, "trainer_logprobs"))})
        for kind in ("processed", "raw"):
            means = [s[kind]["mean"] for s in entry["steps"]]
            maxes = [s[kind]["max"] for s in entry["steps"]]
            entry[f"{kind}_step_mean_range"] = [float(np.nanmin(means)), float(np.nanmax(means))]
            entry[f"{kind}_step_max_range"] = [float(np.nanmin(maxes)), float(np.nanmax(maxes))]
        out.append(entry)
    return out


def totals(table: pa.Table) -> list[dict]:
    """Rows and completion tokens per (source, fault)."""
    grouped = table.group_by(["source", "fault"]).aggregate([("step", "count")])
    result = []
    for row in grouped.to_pylist():
        sub = table.filter(pc.and_(pc.equal(table["source"], row["source"]), pc.equal(table["fault"], row["fault"])))
        result.append({"source": row["source"], "fault": row["fault"], "rows": sub.num_rows,
                       "tokens": int(pc.sum(pc.list_value_length(sub["completion_ids"])).as_py())})
    return sorted(result, key=lambda r: (r["source"], r["fault"]))


def _fmt_range(values: list[float]) -> str:
    return f"{values[0]:.3g}–{values[1]:.3g}"


def markdown(entries: list[dict], total: list[dict]) -> str:
    lines = ["| source | fault | rows | tokens |", "| --- | --- | --- | --- |"]
    lines += [f"| {t['source']} | {t['fault']} | {t['rows']} | {t['tokens']} |" for t in total]
    lines += ["", PUBLISHED, "",
              "Δ = engine − trainer logprob per token. 'proc' uses the engine's processed logprobs (after top-k/top-p), "
              "'raw' its unfiltered ones. Step mean / step max: range over the condition's steps of the per-step "
              "mean and max |Δ|. 'outside': share of tokens with π_trainer/π_engine outside [0.9, 1.1].", "",
              "| source | condition | fault | steps | rows | tokens | trunc | proc mean | proc p99 | proc max | proc outside "
              "| proc step mean | proc step max | raw mean | raw p99 | raw max | raw outside |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in entries:
        p, r = e["processed"], e["raw"]
        lines.append(f"| {e['source']} | {e['condition']} | {e['fault']} | {len(e['steps'])} | {e['rows']} | {e['tokens']} "
                     f"| {e['truncated']:.2f} | {p['mean']:.4f} | {p['p99']:.3f} | {p['max']:.2f} | {100 * p['outside']:.2f} % "
                     f"| {_fmt_range(e['processed_step_mean_range'])} | {_fmt_range(e['processed_step_max_range'])} "
                     f"| {r['mean']:.4f} | {r['p99']:.3f} | {r['max']:.2f} | {100 * r['outside']:.2f} % |")
    return "\n".join(lines) + "\n"


def compact_markdown(entries: list[dict]) -> str:
    """One line per condition: the condition's tail after the model name, per-step mean/max ranges, 'outside' shares."""
    lines = ["| source | condition | fault | steps | tokens | proc step mean | proc step max | proc outside | raw step mean "
             "| raw step max | raw outside |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in entries:
        condition = "/".join(part for part in e["condition"].split("/")[3:] if not part.startswith("fault="))
        lines.append(f"| {e['source']} | {condition} | {e['fault']} | {len(e['steps'])} | {e['tokens']} "
                     f"| {_fmt_range(e['processed_step_mean_range'])} | {_fmt_range(e['processed_step_max_range'])} "
                     f"| {100 * e['processed']['outside']:.2f} % | {_fmt_range(e['raw_step_mean_range'])} "
                     f"| {_fmt_range(e['raw_step_max_range'])} | {100 * e['raw']['outside']:.2f} % |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--compact", type=Path, help="also write the one-line-per-condition table here")
    parser.add_argument("--per-step", action="store_true", help="also print one line per step")
    parser.add_argument("--meta", nargs="*", type=Path, default=[], help="JSON files to embed under 'runs'")
    args = parser.parse_args(argv)
    table = load_rollouts(args.paths)
    entries, total = summarize(table), totals(table)
    text = markdown(entries, total)
    print(text)
    if args.per_step:
        for e in entries:
            for s in e["steps"]:
                p, r = s["processed"], s["raw"]
                print(f"{e['source']} {e['condition']} {e['fault']} step {s['step']}: rows {s['rows']} tokens {s['tokens']} "
                      f"proc mean {p['mean']:.4f} p99 {p['p99']:.3f} max {p['max']:.2f} out {100 * p['outside']:.2f}% | "
                      f"raw mean {r['mean']:.4f} p99 {r['p99']:.3f} max {r['max']:.2f} out {100 * r['outside']:.2f}%")
    if args.json:
        runs = [json.loads(path.read_text()) for path in args.meta]
        args.json.write_text(json.dumps({"published": PUBLISHED, "totals": total, "runs": runs, "conditions": entries}, indent=1))
    if args.md:
        args.md.write_text(text)
    if args.compact:
        args.compact.write_text(compact_markdown(entries))


if __name__ == "__main__":
    main()
