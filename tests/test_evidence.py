import pytest
import torch

from rollout_guard.errors import GuardInputError
from rollout_guard.evidence import RolloutEvidence

B, T = 2, 3


def good(**changes):
    fields = dict(mask=torch.ones(B, T, dtype=torch.long), engine_logprobs=torch.zeros(B, T), trainer_logprobs=torch.zeros(B, T))
    fields.update(changes)
    return RolloutEvidence(**fields)


def test_good_evidence_passes_and_nan_is_not_an_error():
    assert good(engine_logprobs=torch.full((B, T), float("nan"))).validated().batch_size == B


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(mask=torch.ones(B, T, 1, dtype=torch.long)), "mask"),
        (dict(mask=torch.ones(B, T)), "mask"),
        (dict(mask=[[1, 1, 1]]), "mask"),
        (dict(engine_logprobs=torch.zeros(B, T + 1)), "engine_logprobs"),
        (dict(trainer_logprobs=torch.zeros(B, T, dtype=torch.long)), "trainer_logprobs"),
        (dict(trainer_logprobs=torch.zeros(B, T).tolist()), "trainer_logprobs"),
        (dict(engine_logprobs=None, trainer_logprobs=None), "engine_logprobs/trainer_logprobs"),
        (dict(injected=torch.zeros(B + 1, dtype=torch.bool)), "injected"),
    ],
)
def test_structural_problems_name_the_field(changes, field):
    with pytest.raises(GuardInputError) as error:
        good(**changes).validated()
    assert error.value.field == field
    assert "Fix:" in str(error.value)


@pytest.mark.skipif(not hasattr(torch, "device"), reason="torch without devices")
def test_device_mismatch_is_named():
    meta = torch.zeros(B, T, device="meta")
    with pytest.raises(GuardInputError, match="engine_logprobs"):
        good(engine_logprobs=meta).validated()
