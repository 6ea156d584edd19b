import matplotlib.image

from rollout_guard.outputs.charts import delta_heatmap, spike_chart, token_chart
from rollout_guard.outputs.records import QuarantineRecord
from rollout_guard.statistics import DELTA_BIN_EDGES, NUM_DELTA_BINS


def record() -> QuarantineRecord:
    return QuarantineRecord(
        step=3, process_index=0, row=1, global_row=5, group_size=4, action="quarantined", rules=["score"],
        stats={"max_abs_delta": 14.0, "onset_token": 1.0}, prompt_ids=[1], completion_ids=[7, 8, 9],
        prompt_text="abc=", completion_text="xyz", completion_tokens=["x", "y", "z"], engine_logprobs=[-0.01, -0.02, None],
        trainer_logprobs=[-0.02, -14.0, -9.0], reward=0.0, rewards_per_func={}, advantage_before=-1.0, advantage_after=0.0,
        sampling={}, model="m", engine={},
    )


def test_token_chart_and_heatmap_and_spike_chart_render(tmp_path):
    token = token_chart(record(), tmp_path / "token.png")
    heat = delta_heatmap([1, 2, 3], [[5.0] + [0.0] * (NUM_DELTA_BINS - 1)] * 3, DELTA_BIN_EDGES.tolist(), tmp_path / "heat.png")
    history = [{"step": s, "max_abs_delta": 1e-6 if s != 2 else 12.0, "p99_abs_delta": 1e-6, "kept_max_abs_delta": 1e-6,
                "max_score": -2.0 if s != 2 else 40.0, "kept_max_score": -2.0, "score_threshold": 6.9,
                "suspect": float(s == 2), "quarantined": float(s == 2)} for s in range(1, 5)]
    spikes = spike_chart(history, 25.0, tmp_path / "spikes.png")
    for path in (token, heat, spikes):
        image = matplotlib.image.imread(path)
        assert image.shape[0] >= 400 and image.shape[1] >= 800, path
        assert image[..., :3].std() > 0.05, f"{path} looks blank"
