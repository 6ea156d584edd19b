"""The vLLM PR #32118 fault (FAULT INJECTION FOR TESTS) at the level of the two vLLM functions it replaces.

The end-to-end effect on a real engine is tested in test_audit_stress.py; here: the batch split and reorder as
they were before the fix, the firing counter, and that disabling restores vLLM's own functions.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout_guard.testing import engine_faults


@pytest.fixture()
def vllm_modules():
    import vllm.v1.attention.backends.mamba_attn as mamba_attn
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    yield mamba_attn, gpu_model_runner
    engine_faults.disable_stale_mamba_state_fault()


def metadata(query_lens: list[int], computed: list[int], prompt_lens: list[int]) -> SimpleNamespace:
    query = torch.tensor(query_lens)
    seq = torch.tensor(computed) + query
    return SimpleNamespace(
        max_query_len=int(query.max()), num_reqs=len(query_lens), num_actual_tokens=int(query.sum()),
        query_start_loc_cpu=torch.cat([torch.zeros(1, dtype=torch.long), query.cumsum(0)]),
        is_prefilling=torch.tensor(computed) < torch.tensor(prompt_lens), seq_lens_cpu_upper_bound=seq,
    )


def test_a_new_one_token_request_is_split_as_a_decode_only_with_the_fault(vllm_modules):
    mamba_attn, _ = vllm_modules
    # a running request decoding, then a new request that got the step's last token (prompt of 6 tokens)
    batch = metadata(query_lens=[1, 1], computed=[9, 0], prompt_lens=[5, 6])

    def split():
        return mamba_attn.split_decodes_and_prefills(batch, decode_threshold=1, treat_short_extends_as_decodes=False)

    assert split() == (1, 1, 1, 1)  # vLLM 0.31 as shipped: the new request is a prefill (zero initial state)
    with engine_faults.stale_mamba_state_fault() as stats:
        assert split() == (2, 0, 2, 0)  # before the fix: both are decodes; the new one reads its slot's state
        assert stats["new_rows_run_as_decode"] == 1
        # a request continuing its prompt by one token has prior state: not counted as a firing
        assert mamba_attn.split_decodes_and_prefills(metadata([1, 1], [9, 3], [5, 6]), treat_short_extends_as_decodes=False) == (2, 0, 2, 0)
        assert stats["new_rows_run_as_decode"] == 1
    assert split() == (1, 1, 1, 1)


class FakeBatch:
    def __init__(self, scheduled: list[int], computed: list[int]) -> None:
        self.req_ids = [f"r{i}" for i in range(len(scheduled))]
        self.num_computed_tokens_cpu = np.array(computed)
        self.scheduled = dict(zip(self.req_ids, scheduled, strict=True))

    def swap_states(self, i: int, j: int) -> None:
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        self.num_computed_tokens_cpu[[i, j]] = self.num_computed_tokens_cpu[[j, i]]


def test_reorder_puts_every_one_token_row_first_as_before_the_fix():
    # r0 new prefill (5), r1 decode, r2 extend (4), r3 new 1-token request, r4 decode, r5 extend (2)
    batch = FakeBatch(scheduled=[5, 1, 4, 1, 1, 2], computed=[0, 7, 3, 0, 8, 2])
    output = SimpleNamespace(num_scheduled_tokens=dict(batch.scheduled))
    assert engine_faults._prefix_reorder(batch, output, decode_threshold=1)
    assert batch.req_ids == ["r1", "r3", "r4", "r2", "r5", "r0"]  # decodes (new r3 among them), extends, prefills
    assert list(batch.num_computed_tokens_cpu) == [7, 0, 8, 3, 2, 0]
    assert not engine_faults._prefix_reorder(batch, output, decode_threshold=1)  # already in order


def test_enable_is_idempotent_and_disable_restores_vllm(vllm_modules, monkeypatch):
    mamba_attn, gpu_model_runner = vllm_modules
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    split, reorder = mamba_attn.split_decodes_and_prefills, gpu_model_runner.reorder_batch_to_split_decodes_and_prefills
    engine_faults.enable_stale_mamba_state_fault()
    patched = mamba_attn.split_decodes_and_prefills
    engine_faults.enable_stale_mamba_state_fault()
    assert mamba_attn.split_decodes_and_prefills is patched is not split
    assert engine_faults.stale_mamba_state_fault_enabled()
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    engine_faults.disable_stale_mamba_state_fault()
    assert mamba_attn.split_decodes_and_prefills is split
    assert gpu_model_runner.reorder_batch_to_split_decodes_and_prefills is reorder
    assert not engine_faults.stale_mamba_state_fault_enabled()
