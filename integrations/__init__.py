"""Framework adapters of rollout_guard (installed as ``rollout_guard.integrations``).

``rollout_guard.integrations.trl``: attach the guard to a TRL GRPOTrainer, fault injection.
``rollout_guard.integrations.vllm_cpu``: CPU support for TRL's vLLM colocate mode.
``rollout_guard.integrations.tiny_model``: a tiny model + tokenizer built locally for tests and the demo.
"""
