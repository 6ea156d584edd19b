"""What a looser budget buys and what it costs, per run pair (same seed, two configurations), at a fault rate.

For each pair of ``benchmarks/fidelity.py`` results files (``BEFORE AFTER``, the same seed and data): the faulty
rows caught more (every kind but stale weights, which is not corruption; and the late-onset kind alone), the healthy
judgements flagged more (phase 2: resampled clean rows), the distinct healthy rows ever flagged more, and the false
quarantines of unique clean rows more. Then, summed over the pairs, how many healthy rows a run would lose per extra
corrupted row caught where faults are a share ``p`` of its rollouts:

    healthy lost per extra catch = ((1 − p) · Δ flagged / healthy judged) / (p · Δ caught / faulty rows)

The benchmark's own counts are not a run's mix: it judges ~763,000 faulty rows against ~2.59 million healthy
judgements per run, so the raw ratio Δ flagged / Δ caught is the one of a run whose rollouts are ~23 % faulty.

    python benchmarks/results-2026-12-05-thirtyninth/cost_per_catch.py BEFORE.json AFTER.json [BEFORE AFTER ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.fidelity_kit.results_file import read_results  # noqa: E402

SHARES = (0.02, 0.001)  # the benchmark's --fault-share; about one prompt in a thousand (AI21)


def totals(path: str) -> dict[str, float]:
    out = dict.fromkeys(("faulty", "caught", "late", "late_caught", "judged", "flagged", "distinct", "false"), 0)
    for condition in read_results(path)["results"]:
        for kind, figures in condition["figures"].items():
            if kind == "clean":
                out["judged"] += figures["resampled"]["judged"]
                out["flagged"] += figures["resampled"]["false"]
                out["distinct"] += figures["resampled"]["rows_flagged"]
                out["false"] += figures["false"]
            elif kind != "real_stale_weights":
                out["faulty"] += figures["rows"]
                out["caught"] += figures["caught"]
                if kind == "late_onset":
                    out["late"] += figures["rows"]
                    out["late_caught"] += figures["caught"]
    return out


def main(paths: list[str]) -> None:
    if len(paths) % 2:
        raise SystemExit("give BEFORE AFTER pairs")
    summed = {}
    print("| pair | Δ caught (all kinds) | Δ caught (late onset) | Δ flagged judgements | Δ distinct healthy rows "
          "| Δ false quarantines |")
    print("| --- | --- | --- | --- | --- | --- |")
    for before, after in zip(paths[::2], paths[1::2], strict=True):
        a, b = totals(before), totals(after)
        delta = {k: b[k] - a[k] for k in a}
        for k in a:
            summed[k] = summed.get(k, 0) + a[k]
            summed["d_" + k] = summed.get("d_" + k, 0) + delta[k]
        print(f"| {Path(before).name} → {Path(after).name} | {delta['caught']:+d} | {delta['late_caught']:+d} | "
              f"{delta['flagged']:+d} of {a['judged']:,} | {delta['distinct']:+d} | {delta['false']:+d} |")
    false_up = summed["d_flagged"] / summed["judged"]
    print(f"\nHealthy judgements flagged: +{summed['d_flagged']:,} of {summed['judged']:,} "
          f"(+{100 * false_up:.4f} percentage points)")
    for label, caught, rows in (("every kind", summed["d_caught"], summed["faulty"]),
                                ("late onset alone", summed["d_late_caught"], summed["late"])):
        recall_up = caught / rows
        ratios = ", ".join(f"{((1 - p) * false_up) / (p * recall_up):,.0f} at {100 * p:g} %" if caught > 0 else
                           f"– at {100 * p:g} %" for p in SHARES)
        print(f"Faults of {label}: +{caught:,} caught of {rows:,} (+{100 * recall_up:.4f} percentage points); healthy "
              f"rows flagged per extra corrupted row caught where faults are a share p of the rollouts: {ratios}")


if __name__ == "__main__":
    main(sys.argv[1:])
