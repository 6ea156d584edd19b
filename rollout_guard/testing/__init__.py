"""Helpers for tests and the demo, not adapters: ``tiny_model`` (a tiny model and tokenizer built locally in
seconds, nothing downloaded) and ``engine_faults`` (FAULT INJECTION FOR TESTS, never on by default: the stale Mamba
state bug of vLLM PR #32118 reinstated in the vLLM CPU build, so that tests and ``rollout-guard audit`` see the bug
class the guard exists for on a real engine). Both need the ``cpu`` extra (transformers; vLLM for the faults)."""
