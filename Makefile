# fastamp developer entry points. Every target sets itself up from nothing: a local
# virtualenv (.venv) with pinned dependencies, then the C++ extension built in place.
#   make test      - the whole test suite (what CI runs, via .ci/run): lint, pytest, then the
#                    CUDA-build tier (a CUDA torch in .venv-cuda, the extension built with
#                    its CUDA kernels, imported and tested on CPU; skipped without nvcc)
#   make compare   - the main job: end-to-end mixed-precision comparison (table + CSV + PNG)
#   make bench     - the microbenchmarks (CSV + PNG under benchmarks/results/)
#   make lint      - ruff (check + format) and clang-format on csrc/ (.clang-format)

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.deps-stamp
BUILD   = $(VENV)/.build-stamp
SOURCES = $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' 2>/dev/null) setup.py

.PHONY: env build test test-cuda-build compare bench lint clean

$(STAMP): requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

env: $(STAMP)

$(BUILD): $(STAMP) $(SOURCES)
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	$(PY) -m fastamp.env
	touch $@

build: $(BUILD)

# The oldest Triton we support (torch 2.6's), beside the pinned one: the AOT tier
# (tests/tools/test_triton_aot.py) compiles its cover with both. --target keeps it out of .venv's
# own site-packages; FASTAMP_AOT_TRITON puts it first on the compile workers' PYTHONPATH.
OLD_TRITON     = triton==3.2.0
OLD_TRITON_DIR = $(VENV)/triton-3.2.0
$(OLD_TRITON_DIR)/.stamp: $(STAMP)
	$(PY) -m pip install --quiet --no-deps --target $(OLD_TRITON_DIR) $(OLD_TRITON)
	touch $@

# --dist loadfile: each test file on one xdist worker, so that a module's expensive fixtures (the
# Triton AOT and CUDA compiles, the 2-rank run, the benchmark smoke runs, the matrix's reference
# cache) run once per run. (--dist loadgroup with xdist_group marks would do it per module, but
# pytest-xdist 3.8.0 under pytest 9.2 ignores the marks: measured 2026-12-07, both workers ran the
# AOT module, one idle ~70 s on the other's compile lock, and the smoke runs' fixtures ran twice.)
test: $(BUILD) $(OLD_TRITON_DIR)/.stamp
	$(MAKE) lint
	FASTAMP_AOT_TRITON=$(abspath $(OLD_TRITON_DIR)) $(PY) -m pytest -q -n auto --dist loadfile tests
	$(MAKE) test-cuda-build

test-cuda-build:
	PYTHON=$(PYTHON) bash tests/tools/cuda_build_tier.sh

compare: $(BUILD)
	$(PY) -m fastamp.compare

bench: $(BUILD)
	PYTHON=$(abspath $(PY)) bash benchmarks/run_all.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check fastamp kernels tests benchmarks setup.py
	$(VENV)/bin/ruff format --check fastamp kernels tests benchmarks setup.py
	find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' | \
		xargs $(VENV)/bin/clang-format --dry-run --Werror

clean:
	rm -rf build $(VENV) .venv-cuda fastamp/_C*.so *.egg-info
