"""The verdict through the guard: each reason fires alone on its own evidence, at its documented boundary, and
several reasons on one rollout are all named and counted."""

import math

import torch

from rollout_guard import GuardConfig, RolloutEvidence, RolloutGuard
from rollout_guard.verdict import RULE_BIT, RULE_TEXT, RULES, rule_counts, rule_names


def quiet(rows: int, tokens: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose trainer agrees with the engine to 0.02 nats (healthy bf16 noise)."""
    generator = torch.Generator().manual_seed(seed)
    engine = -0.05 - 2.0 * torch.rand(rows, tokens, generator=generator)
    trainer = engine + 0.02 * torch.randn(rows, tokens, generator=generator)
    return engine, trainer


def judged(engine: torch.Tensor, trainer: torch.Tensor, config: GuardConfig | None = None) -> list[list[str]]:
    mask = torch.ones(engine.shape, dtype=torch.bool)
    report = RolloutGuard(config or GuardConfig()).inspect(RolloutEvidence(mask, engine, trainer), step=0)
    return [rule_names(int(reason)) for reason in report.reasons]


def test_each_reason_fires_alone_on_its_evidence():
    engine, trainer = quiet(64)
    engine[1, 3] = math.nan
    trainer[2, 7] = math.inf
    trainer[3, 10] = engine[3, 10] - 9.0  # one token the engine favours by 9 nats: the score
    verdicts = judged(engine, trainer)
    assert verdicts[:4] == [[], ["nonfinite_engine"], ["nonfinite_trainer"], ["score"]]
    assert all(verdict == [] for verdict in verdicts[4:])  # clean negatives


def test_the_ceiling_fires_past_its_value_and_not_at_it():
    """The ceiling is strict (|Δ| > ceiling_delta); at 20 nats a trainer-favouring token fires it alone."""
    engine, trainer = quiet(64, seed=1)
    engine[0, 4], trainer[0, 4] = -30.0, -10.0  # 20 nats, the trainer favours it
    engine[1, 4], trainer[1, 4] = -30.0, -9.99  # 20.01 nats
    config = GuardConfig(ceiling_delta=20.0)
    verdicts = judged(engine, trainer, config)
    assert "ceiling" not in verdicts[0] and "ceiling" in verdicts[1]
    assert "ceiling" not in judged(engine, trainer, GuardConfig(ceiling_delta=None))[1]


def test_a_rollout_without_a_compared_token_is_never_suspect():
    engine, trainer = quiet(8, seed=2)
    mask = torch.ones(engine.shape, dtype=torch.bool)
    mask[0] = False
    report = RolloutGuard().inspect(RolloutEvidence(mask, engine, trainer), step=0)
    assert not report.suspect[0] and math.isnan(float(report.column("score")[0]))


def test_several_reasons_on_one_rollout_are_all_named_and_counted():
    engine, trainer = quiet(64, seed=3)
    engine[0, 2] = math.nan
    trainer[0, 9] = engine[0, 9] - 30.0  # past the 25-nat ceiling and far over the score's threshold
    trainer[1, 9] = engine[1, 9] - 30.0
    mask = torch.ones(engine.shape, dtype=torch.bool)
    report = RolloutGuard().inspect(RolloutEvidence(mask, engine, trainer), step=0)
    assert rule_names(int(report.reasons[0])) == ["nonfinite_engine", "ceiling", "score"]
    assert rule_counts(report.reasons) == {"nonfinite_engine": 1, "nonfinite_trainer": 0, "ceiling": 2, "score": 2,
                                           "tolerance": 0}
    assert sorted(RULE_BIT.values()) == [1 << i for i in range(len(RULES))]
    assert set(RULE_TEXT) == set(RULES)


def test_a_record_gives_the_onset_as_loss_mask_tokens_before_it_and_explains_the_verdict():
    """verdict_fields: the onset's padded position becomes the count of loss-mask tokens before it; a row without an
    onset keeps NaN; the rules and the sentence follow from the verdict bits."""
    from rollout_guard.outputs.records import verdict_fields
    from rollout_guard.statistics import SAMPLE_COLUMNS

    values = {"score": 25.5, "onset_token": 9.0, "onset_engine_logprob": -3.5, "onset_trainer_logprob": -12.7,
              "noise_scale": 0.25}
    sample = [values.get(name, 0.0) for name in SAMPLE_COLUMNS]
    fields = verdict_fields(sample, RULE_BIT["score"], 6.9, tokens_before_onset=7.0)
    assert fields["stats"]["onset_token"] == 7.0 and fields["rules"] == ["score"]
    assert fields["explanation"].startswith("suspect: from token 7 (engine -3.5, trainer -12.7 nats)")
    sample[SAMPLE_COLUMNS.index("onset_token")] = math.nan
    fields = verdict_fields(sample, RULE_BIT["nonfinite_engine"], 6.9, tokens_before_onset=math.nan)
    assert math.isnan(fields["stats"]["onset_token"]) and fields["rules"] == ["nonfinite_engine"]
