"""A host exception on one process at any site before one of the adapter's collectives leaves no process waiting:
both skip the step together, or (outputs only) the failing one counts it and both train on (two CPU processes,
gloo)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.integrations.one_rank_faults import GENERATIONS, SITES, STEPS
from tests.processes import launch


def test_a_host_exception_on_one_process_before_a_collective_skips_together_and_nothing_hangs(tiny_model_dir,
                                                                                             tmp_path):
    """Rank 1 raises at step 3 (a generation step) in the truncated-row search (before the truncated-row pass's
    gather), in the loss token count (before the quarantine's gather), in adding engine context to its records and
    in pickling its records (both before the records' ``gather_object``). The first two: the step's evidence fails on rank 1, the
    failure travels in the step's one gather and both ranks pass that step through unguarded (one failure each);
    the last two: the step is judged, rank 1 counts one output failure. Every rank trains every step, none raises,
    within the collectives' 60 s timeout."""
    done = launch(Path(__file__).with_name("one_rank_faults.py"), tiny_model_dir, tmp_path, processes=2,
                  timeout=480, env={"TRL_EXPERIMENTAL_SILENCE": "1"})
    log = (done.stdout + done.stderr)[-6000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    assert done.returncode == 0 and all(set(rank) == set(SITES) for rank in ranks), (ranks, log)
    for site in SITES:
        first, second = ranks[0][site], ranks[1][site]
        assert first["error"] is None and second["error"] is None, (site, first, second)
        assert first["step"] == second["step"] == STEPS, (site, first, second)
        skipped = site in ("truncated_rows", "loss_tokens")
        assert first["failures"] == second["failures"] == int(skipped), (site, first, second)
        assert first["steps"] == second["steps"] == GENERATIONS - int(skipped), (site, first, second)
        assert (first["output_failures"], second["output_failures"]) == (0, int(not skipped)), (site, first, second)
