# `make bench` and `make test` each create .venv when missing, install torchspeed into it, and run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# `make bench`: ResNet-20 on the real handwritten digits: the throughput table (naive, each technique,
# hand, all) and the time-to-target tables (naive, all and auto: the shortest step budget that ends at
# 97% and 90% validation accuracy on 3 seeds, naive, all, auto cold and warm, Schedule-Free AdamW); 30 minutes on
# a 2-core AVX2 EPYC. `make bench BENCH_ARGS=` runs the full default bench instead.
BENCH_ARGS ?= --data digits --model resnet20 --quick
# torch/torchvision pins: the pair that installs together from PyPI on x86_64 Linux with Python 3.11.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

.PHONY: bench test install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PINS)
	$(PY) -m pip install --quiet -e '.[all,dev]'
	touch $@

install: $(VENV)/.installed

bench: install
	$(VENV)/bin/torchspeed bench $(BENCH_ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info
