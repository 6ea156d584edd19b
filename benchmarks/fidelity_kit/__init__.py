"""Parts of the detection fidelity benchmark (``benchmarks/fidelity.py``).

* :mod:`.rollouts`: padded tensors of clean rollouts loaded from ``benchmarks/fidelity_data/*.parquet``.
* :mod:`.noise`: noise models fitted to published mismatch figures, applied on top of real rollouts.
* :mod:`.zoo`: the fault zoo, each fault documented with the real failure it models.
* :mod:`.score`: Wilson intervals and the streaming replay through :class:`rollout_guard.RolloutGuard`.
* :mod:`.results_file`: reading a results JSON, plain or gzipped (the results folders keep theirs gzipped).
"""
