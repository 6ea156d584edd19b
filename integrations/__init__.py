"""Framework adapters of rollout_guard, installed as ``rollout_guard.integrations``.

``trl``: attach the guard to a TRL GRPOTrainer (``attach_guard``), vLLM fault injection (a package, one module per
concern); ``trl_versions``: the supported TRL releases (1.14–1.16), how errors name the installed one, and the installed
TRL/vLLM/transformers versions for records.
``verl``: the guarded verl v1 trainers (``trainer.v1.trainer_mode=guarded_sync``), registered by a ``verl.plugins``
entry point; the rows they leave out get no vote in any group baseline.
``vllm_cpu``: CPU support for TRL's vLLM colocate mode and a vLLM server command for the CPU build.
``vllm_tools``: ``rollout-guard audit`` and ``replay`` (a vLLM engine next to transformers).
``rescoring``: batched re-scoring of rollouts with transformers (and the per-sample reference).
``hf_rollouts``: a transformers rollout engine (``rollout_func``) with engine logprobs.
``wandb`` and ``trackio``: sinks for those trackers.
The test and demo helpers (tiny model, engine faults) are in ``rollout_guard.testing``.
"""
