# Quick start: `make serve` and `make test`. Both build .venv from nothing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install serve test bench clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: a looser range would pull the CUDA build (several GB).
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

install: $(STAMP)

# Ray Serve on 127.0.0.1:8000: ingress + prefill + decode of the embedded tiny-llama.
serve: install
	$(VENV)/bin/serve run configs/local.yaml

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/engine_throughput.py --json benchmarks/engine_throughput.json

clean:
	rm -rf $(VENV)
