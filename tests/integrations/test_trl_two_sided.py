"""A setup that compares engine and trainer logprobs checks every step that both arrived (real TRL GRPOTrainer,
transformers rollouts, this process)."""

from __future__ import annotations

import json
from pathlib import Path

from rollout_guard.integrations.hf_rollouts import TransformersRollouts
from tests.integrations.test_trl_attach import make_trainer


class _LogprobsDropped(TransformersRollouts):
    """Transformers rollouts that return no engine logprobs in the generation calls numbered in ``dropped``
    (1-based), as a rollout_func whose engine stopped reporting them."""

    def __init__(self, dropped: set[int]) -> None:
        super().__init__()
        self.dropped, self.calls = dropped, 0

    def __call__(self, prompts, trainer):  # noqa: ANN001
        output = super().__call__(prompts, trainer)
        self.calls += 1
        if self.calls in self.dropped:
            output["logprobs"] = None
        return output


def test_a_batch_without_engine_logprobs_in_a_two_sided_setup_is_a_metric_and_an_error_alert(tiny_model_dir,
                                                                                            tmp_path):
    """Step 2's batch has no engine logprobs: the step is judged on non-finite values only, as before, but its
    metric two_sided is 0 (1 on the other steps) and an error alert names it."""
    from rollout_guard import GuardConfig
    from rollout_guard.integrations.trl import attach_guard

    trainer = make_trainer(tiny_model_dir, tmp_path / "trainer", rollouts=_LogprobsDropped({2}), max_steps=3)
    guarded = attach_guard(trainer, GuardConfig(output_dir=str(tmp_path / "guard")))
    trainer.train()
    folder = Path(guarded.output_dir)
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [line["two_sided"] for line in lines] == [1.0, 0.0, 1.0]
    alerts = [json.loads(line) for line in (folder / "alerts.jsonl").read_text().splitlines()]
    one_sided = [alert for alert in alerts if alert["kind"] == "one_sided"]
    assert [(alert["step"], alert["level"]) for alert in one_sided] == [(2, "ERROR")], alerts
    assert "process(es) [0]" in one_sided[0]["text"]
