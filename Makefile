# `make bench` and `make test` each create .venv when missing, install torchspeed into it, and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# `make bench`: the suite (docs/bench.md): time to target on six small workloads of different kinds (a 1D CNN,
# a tabular MLP, a transformer, a digits CNN, a regression, a character-level GRU language model), rows naive,
# fit, all, schedulefree, onecycle, auto (cold) and auto_warm on 3 seeds, scored as AlgoPerf does: about 3 minutes
# on an idle 2-core Zen 5 EPYC, 7 on a 2-core AVX2-only EPYC, at most 10 minutes on busy cores.
# `make bench-full`: the throughput bench (each technique alone, hand, all) and time to 97% and 90% on the digits
# with ResNet-20 (BENCH_FULL_ARGS): 21 minutes on a 2-core AVX2 EPYC.
BENCH_ARGS ?=
BENCH_FULL_ARGS ?= --data digits --model resnet20 --quick
# torch/torchvision pins: the pair that installs together from PyPI on x86_64 Linux with Python 3.11.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

.PHONY: bench bench-full test install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PINS)
	$(PY) -m pip install --quiet -e '.[all,dev]'
	touch $@

install: $(VENV)/.installed

bench: install
	$(VENV)/bin/torchspeed bench $(BENCH_ARGS)

bench-full: install
	$(VENV)/bin/torchspeed bench $(BENCH_FULL_ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info
