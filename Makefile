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
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The engine on the embedded tiny-llama: an interactive prompt on stdin.
serve: install
	$(VENV)/bin/pdserve chat --model tiny-llama

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/engine_throughput.py --json benchmarks/engine_throughput.json

clean:
	rm -rf $(VENV)
