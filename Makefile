# `make bench` and `make test` each create .venv when missing, install torchspeed into it, and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch/torchvision pins: the pair that installs together from PyPI on x86_64 Linux with Python 3.11.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

.PHONY: bench test install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PINS)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

bench: install
	$(VENV)/bin/torchspeed bench $(BENCH_ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info
