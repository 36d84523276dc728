# Two commands do all the set-up on a fresh machine:
#   make demo   - build fastamp in .venv and train fastamp vs torch side by side
#   make test   - build fastamp in .venv and run the test suite (what CI runs)
# TORCH_SPEC picks the torch to build against (default: the CPU 2.13.0 wheel; use torch==2.14.1 for CUDA).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: demo test bench cuda-build emu emu-faults sanitize lint clean

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" "scikit-build-core>=0.10" cmake ninja numpy pytest expecttest hypothesis tqdm matplotlib
	touch $@

$(VENV)/.built: $(VENV)/.deps pyproject.toml CMakeLists.txt $(shell find csrc cmake -type f 2>/dev/null)
	FASTAMP_CUDA=$(or $(FASTAMP_CUDA),AUTO) FASTAMP_WERROR=ON $(PIP) install -q --no-build-isolation --no-deps -e . -Cbuild-dir=build/$(notdir $(VENV))
	touch $@

demo: $(VENV)/.built
	$(PY) examples/demo.py

# The CUDA emulator library: every csrc/**/*.cu compiled by g++ against this venv's torch
# (tests/cuda_emu/build.py; cached objects, so this is quick when nothing changed). tests/cuda_emu
# runs the CUDA host launchers and kernels on it against the CPU kernels.
emu: $(VENV)/.built
	$(PY) tests/cuda_emu/build.py

test: emu
	$(PY) .ci/check_fp_contract.py build/$(notdir $(VENV))
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Planted faults (a removed barrier, a wrong chunk index, a divergent shuffle, a misaligned 16-byte
# load, an out-of-bounds write): each is built into its own emulator library and must make the
# emulated tests fail with the expected report (tests/cuda_emu/mutants.py).
emu-faults: emu
	$(PY) tests/cuda_emu/mutants.py

bench: $(VENV)/.built
	$(PY) benchmarks/scaler/bench_grad_scaler.py
	$(PY) benchmarks/optim/bench_optim_step.py
	$(PY) benchmarks/checkpoint/bench_checkpoint.py

# The CUDA flavour: torch 2.14.1 (CUDA 13.0) + nvcc; builds the CUDA kernels (no GPU needed),
# checks every op has a CUDA kernel registered, that no multiply-add is fused (CPU objects, PTX),
# and runs the host-side checks of the CUDA driver.
cuda-build:
	$(MAKE) $(VENV)-cuda/.built VENV=$(VENV)-cuda TORCH_SPEC=torch==2.14.1 FASTAMP_CUDA=ON
	$(VENV)-cuda/bin/python .ci/check_cuda_build.py
	$(VENV)-cuda/bin/python .ci/check_fp_contract.py build/$(notdir $(VENV))-cuda
	tests/cuda_host/run.sh $(VENV)-cuda/bin/python

# The CPU kernels under AddressSanitizer + UndefinedBehaviorSanitizer: a non-editable, unstripped
# -O1 -g build into its own venv (build/asan), then tests/sanitize/run.sh: the harness self-test,
# then the op, fuzz and class tests with the sanitizer runtime preloaded; fails on any report.
# tests/sanitize/run.sh also builds the CUDA emulator library with the same sanitizers and runs the
# emulated CUDA tests on it.
# float-cast-overflow is not part of GCC's "undefined" but is UB the inf/NaN tests could reach
# (a non-finite float converted to an integer); float-divide-by-zero stays off: x/0 -> inf is the
# IEEE behaviour the kernels rely on.
ASAN_VENV := $(VENV)-asan
ASAN_PY := $(ASAN_VENV)/bin/python

$(ASAN_VENV)/.deps:
	$(PYTHON) -m venv $(ASAN_VENV)
	$(ASAN_PY) -m pip install -q --upgrade pip
	$(ASAN_PY) -m pip install -q "$(TORCH_SPEC)" "scikit-build-core>=0.10" cmake ninja numpy pytest expecttest hypothesis
	touch $@

# Non-editable, so the Python sources are inputs too (and this Makefile: it holds the sanitizer list).
$(ASAN_VENV)/.built: $(ASAN_VENV)/.deps Makefile pyproject.toml CMakeLists.txt $(shell find csrc cmake python -type f -not -name '*.pyc' 2>/dev/null)
	FASTAMP_CUDA=OFF $(ASAN_PY) -m pip install -q --no-build-isolation --no-deps --force-reinstall . \
	  -Cbuild-dir=build/asan -Cinstall.strip=false \
	  -Ccmake.define.FASTAMP_SANITIZE="address;undefined;float-cast-overflow" -Ccmake.define.FASTAMP_WERROR=ON
	touch $@

sanitize: $(ASAN_VENV)/.built
	tests/sanitize/run.sh $(ASAN_PY)

lint:
	$(PY) -m pip install -q ruff
	$(PY) -m ruff check python tests benchmarks examples

clean:
	rm -rf build $(VENV) $(VENV)-cuda $(VENV)-asan
