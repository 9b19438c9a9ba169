# Two commands do everything on a fresh machine:
#   make demo   # creates .venv if missing, installs, runs the side-by-side demo
#   make test   # creates .venv if missing, installs, runs the test suite
# (`make test-models` and `make test-kernels` run the matrix cells that `make test` leaves out; CI runs all three)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf-paged-installed

.PHONY: demo test test-models test-kernels test-compat test-hf test-hf-all bench bench-smoke bench-compare kernel-bench gpu-check install clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pin torch first: a bare `torch` requirement would pull a multi-GB build on a machine without one.
	# On a CUDA machine the same pin installs the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m hf_paged demo

# The suite, with a slice of each per-model-family matrix (tests/matrix.py and tests/vlm_matrix.py MAKE_TEST: every
# attention path and kind of clear error) and of the Triton kernels' float8 and ahead-of-time compile cells; the
# other cells are marked `models` (test-models) and `kernels` (test-kernels).
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -q -m "not models and not kernels"

test-models: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -q -m models

test-kernels: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -q -m kernels

# transformers' own generation tests (../shared/hf-tests) without and with hf-paged, on every model type the
# support table serves: no regression allowed (tests/hf_suite/run.py). The torch.compile tests run on the
# suite's own modules (llama, mistral, qwen2, gemma2); test-hf-all runs them on every family too (not in CI: time).
#   make test-hf HF_SUITE_ARGS="--families qwen3,gpt2 --out /tmp/hf-suite"
test-hf: $(STAMP)
	$(PY) -m tests.hf_suite.run $(HF_SUITE_ARGS)

test-hf-all: $(STAMP)
	$(PY) -m tests.hf_suite.run --compile-tests all $(HF_SUITE_ARGS)

# The focused compatibility subset against other transformers releases, each in .venv-compat/<version>:
#   make test-compat                                   # the floor, 5.23 and 5.24 (see hf_paged/compat.py)
#   HF_PAGED_TRANSFORMERS="5.21.1 5.22.0" make test-compat
HF_PAGED_TRANSFORMERS ?= 5.20.0 5.23.0 5.24.0
test-compat:
	bash tests/compat/run.sh $(PYTHON) $(HF_PAGED_TRANSFORMERS)

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

bench-smoke: $(STAMP)
	$(PY) -m benchmarks.run_all --smoke

# A commit's benchmarks against another's, alternately in fresh processes (benchmarks/README.md):
#   make bench-compare BASE=3ee58c1                      # vs this working tree as it is
#   make bench-compare BASE=3ee58c1 HEAD=main BENCH=decode,host ARGS="--batch-sizes 8 --repeats 3"
BENCH ?= decode
bench-compare: $(STAMP)
	@test -n "$(BASE)" || { echo "give the base commit: make bench-compare BASE=<commit> [HEAD=<commit>]"; exit 2; }
	$(PY) -m benchmarks.compare $(BASE) $(HEAD) --bench $(BENCH) $(ARGS)

kernel-bench: $(STAMP)
	$(PY) -m benchmarks.kernel_bench

# On a CUDA machine (about 6 minutes on one H200): the GPU tests and the kernel tests compiled on the device, doctor,
# generate() and the compiled Engine on a ~1B Llama, kernel bench, launch overhead (docs/gpu.md)
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info
