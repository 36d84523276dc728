# Two commands do all the set-up on a fresh machine:
#   make demo   - build fastamp in .venv and train fastamp vs torch side by side
#   make test   - build fastamp in .venv and run the quick test tier (tests: under 3 min on 2 idle cores)
#   make test-all - make test, then the tests marked full (CI runs the two as make test, make test-full)
# TORCH_SPEC picks the torch to build against (default: the CPU 2.13.0 wheel; use torch==2.14.1 for CUDA).
# A bare `make` (or `make help`) lists every target.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=
# Extra pip arguments for the .deps step (the clients tier adds its pinned client libraries).
EXTRA_DEPS ?=

.PHONY: help demo test test-full test-all test-capabilities test-clients test-matrix test-matrix-ci wheel wheel-cpu bench cuda-build gpu-check gpu-resources gpu-traffic mutate mutate-sample mutate-cpu mutate-python emu emu-faults sanitize lint format clean
.DEFAULT_GOAL := help

# The build tools, pinned as the Dockerfile pins them (what CI builds with).
BUILD_TOOLS := "scikit-build-core==1.1.2" "cmake==4.4.5" "ninja==1.13.2"

help:
	@echo "fastamp's make targets (each builds what it needs first, in .venv unless said):"
	@echo "  make demo          build, then train fastamp vs torch side by side (examples/demo.py)"
	@echo "  make test          build, build the CUDA emulator library, run the quick test tier (tests: under 3 min on 2 idle cores)"
	@echo "  make test-full     the tests marked full only (the rest of the suite after make test; CI runs both)"
	@echo "  make test-all      make test, then make test-full: the whole suite, each test once"
	@echo "  make test-capabilities  the differential tests vs torch under each CPU capability below this machine's (CI runs it)"
	@echo "  make emu           build the CUDA emulator library only"
	@echo "  make emu-faults    planted CUDA faults the emulated tests must catch"
	@echo "  make mutate        generated mutants of the CUDA kernels vs the emulated tests (score, survivors)"
	@echo "  make mutate-cpu    generated mutants of the CPU kernels, rebuilt one by one (in a worktree of HEAD)"
	@echo "  make mutate-python AST mutants of the scaler/optimizer step logic (in a worktree of HEAD)"
	@echo "  make test-clients  the Lightning / accelerate / transformers tier, in .venv-clients"
	@echo "  make wheel         the CPU and CUDA abi3 wheels and the sdist in dist/, audited"
	@echo "  make wheel-cpu     the CPU wheel alone (fastamp-<version>+cpu-...whl in dist/cpu/, no nvcc needed), audited"
	@echo "  make test-matrix   the CPU wheel installed beside other torch releases, tested (MATRIX=...)"
	@echo "  make test-matrix-ci  the floor and newest torch beside .venv's library (what CI runs)"
	@echo "  make bench         the scaler, optimizer and checkpoint benchmarks (benchmarks/ has more)"
	@echo "  make cuda-build    build the CUDA flavour against torch 2.14.1 in .venv-cuda (nvcc needed)"
	@echo "  make gpu-check     the GPU tier: kernels vs CPU bit for bit, CUDA tests, ncu traffic, GPU benchmarks"
	@echo "  make gpu-resources registers/spills/occupancy per CUDA kernel (sm_80/86/90): docs/gpu_resources.md"
	@echo "  make gpu-traffic   memory requests/sectors/bytes per CUDA kernel under the emulator: docs/gpu_traffic.md"
	@echo "  make sanitize      CPU kernels and the emulator under ASan + UBSan, in .venv-asan"
	@echo "  make lint          ruff format --check, ruff check, clang-format, mypy ratchet (make format fixes)"
	@echo "  make clean         remove build/ and the venvs"
	@echo "TORCH_SPEC=torch==X picks the torch to build against (default $(TORCH_SPEC)); the full"
	@echo "compile log goes to build/<venv>.log, its steps print as [n/N] lines."

# A requirements file passed in EXTRA_DEPS (-r FILE) is a prerequisite: changed pins reinstall.
$(VENV)/.deps: requirements/wheel.txt $(filter-out -r,$(EXTRA_DEPS))
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo "installing $(TORCH_SPEC) and the build/test tools into $(VENV) (a minute or more: torch is large) ..."
	$(PIP) install -q "$(TORCH_SPEC)" $(BUILD_TOOLS) -r requirements/wheel.txt numpy pytest pytest-xdist==3.8.0 expecttest hypothesis tqdm matplotlib $(EXTRA_DEPS)
	touch $@

$(VENV)/.built: $(VENV)/.deps pyproject.toml CMakeLists.txt $(shell find csrc cmake -type f 2>/dev/null)
	@echo "compiling fastamp's C++ kernels against $$($(PY) -c 'import torch; print("torch", torch.__version__)') (a few minutes on 2 cores; full log: build/$(notdir $(VENV)).log) ..."
	@mkdir -p build
	@set -o pipefail; FASTAMP_CUDA=$(or $(FASTAMP_CUDA),AUTO) FASTAMP_WERROR=ON $(PIP) install -v --no-build-isolation --no-deps -e . -Cbuild-dir=build/$(notdir $(VENV)) 2>&1 \
	  | tee build/$(notdir $(VENV)).log | { grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\]|-- fastamp:' || true; } \
	  || { grep -E -A8 'CMake Error|error:|FAILED:' build/$(notdir $(VENV)).log | head -80; \
	       echo "fastamp: the build failed; full log: build/$(notdir $(VENV)).log"; exit 1; }
	touch $@

demo: $(VENV)/.built
	$(PY) examples/demo.py

# The CUDA emulator library: every csrc/**/*.cu compiled by g++ against this venv's torch
# (tests/cuda_emu/build.py; cached objects, so this is quick when nothing changed). tests/cuda_emu
# runs the CUDA host launchers and kernels on it against the CPU kernels.
emu: $(VENV)/.built
	$(PY) tests/cuda_emu/build.py

# The test tiers (README "Tests"). `make test` is the quick tier: every capability, without the
# tests marked `full` (the soak, the multi-process parity suites, the emulator's whole case matrix).
# `make test-full` runs only the tests marked `full`; `make test-all` is both, each test once (the
# full suite, everything but `slow`, as a bare `pytest` selects, in two sessions). CI runs
# `make test` then `make test-full`. The argument-coverage check judges the whole suite: a whole
# quick tier that passed saves its records (ARGCOV_QUICK), and the `full` session adds them
# (tests/conftest.py). pytest prints a line per test file with the run's progress; --durations
# names the slowest tests at the end.
QUICK_TIER := -m "not slow and not full"
FULL_ONLY := -m full
ARGCOV_QUICK := build/argcov-quick.json
# Both tiers run in TEST_WORKERS pytest-xdist processes (default: one per core; TEST_WORKERS=1 runs
# one process, as a bare pytest does), each test file in one worker (--dist loadfile: a module's
# fixtures and order as in one process). The workers' argument-coverage records are added up by
# the controller (tests/conftest.py). OMP_WAIT_POLICY=passive: each worker keeps torch's intra-op
# threads (the kernels' threaded paths stay tested), which then sleep rather than spin while they
# wait, so two workers' thread pools share the cores instead of burning them.
# (A venv made before pytest-xdist joined the .deps list runs one process: `rm $(VENV)/.deps`
# reinstalls.)
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)
PARALLEL = $(and $(filter-out 0 1,$(TEST_WORKERS)),$(shell $(PY) -c 'import xdist' 2>/dev/null && echo yes))
XDIST = $(if $(PARALLEL),-n $(TEST_WORKERS) --dist loadfile,-p no:xdist)
TEST_ENV = $(if $(PARALLEL),OMP_WAIT_POLICY=passive,)

test: emu
	$(PY) .ci/check_fp_contract.py build/$(notdir $(VENV))
	FASTAMP_ARGCOV_SAVE=$(ARGCOV_QUICK) $(TEST_ENV) $(PY) -m pytest $(QUICK_TIER) $(XDIST) --durations=5 $(PYTEST_ARGS)

test-full: emu
	FASTAMP_ARGCOV_PRIOR=$(ARGCOV_QUICK) $(TEST_ENV) $(PY) -m pytest $(FULL_ONLY) $(XDIST) --durations=10 $(PYTEST_ARGS)

test-all: test
	$(MAKE) --no-print-directory test-full

# The differential tests against torch (params, state and scale vs torch's, ill-conditioned cases
# vs a float64 run) under each CPU capability this machine offers below its own (make test ran
# that one): fastamp's kernels capped with FASTAMP_CPU_CAPABILITY and torch's with
# ATEN_CPU_CAPABILITY, so an AVX-512 machine also runs what an AVX2-only one (AMD Zen 3) and the
# baseline build compute. The files that compare with torch's bits, not the whole quick tier
# (tests/optim + tests/scaler take about 5 minutes per capability on 2 cores; these about 35 s).
# tests/*/test_cpu_capabilities.py (in the quick tier) holds every op equal across capabilities.
CAPABILITY_TESTS ?= tests/optim/test_step_plan.py tests/optim/test_optim_fidelity.py \
  tests/optim/test_cpu_capabilities.py tests/scaler/test_scaler_fidelity.py
test-capabilities: $(VENV)/.built
	@native=$$($(PY) -c 'import fastamp; print(fastamp.build_info()["cpu_capability"])'); \
	caps=$$(case $$native in avx512) echo "default avx2";; avx2) echo default;; *) echo;; esac); \
	echo "CPU capability of this machine: $$native; the differential tests under: $${caps:-none below it}"; \
	for c in $$caps; do \
	  echo "=== FASTAMP_CPU_CAPABILITY=$$c ATEN_CPU_CAPABILITY=$$c ==="; \
	  FASTAMP_CPU_CAPABILITY=$$c ATEN_CPU_CAPABILITY=$$c $(TEST_ENV) $(PY) -m pytest $(QUICK_TIER) -q -p no:cacheprovider \
	    $(XDIST) $(CAPABILITY_TESTS) $(PYTEST_ARGS) || exit 1; \
	done

# Planted faults (a removed barrier, a wrong chunk index, a divergent shuffle, a misaligned 16-byte
# load, an out-of-bounds write, six in the low-precision kernels (one of them moving one element per lane, which the traffic budget must catch) and a half store rounding ties away; tests/cuda_emu/mutants.py): each is built into its own emulator library and must make the
# emulated tests fail with the expected report.
emu-faults: emu
	$(PY) tests/cuda_emu/mutants.py

# The clients tier: Lightning, accelerate and transformers (pinned in requirements/) beside
# the same torch, in their own venv, with fastamp as .venv built it (copied, not compiled again:
# .ci/share_build.py); runs every test marked `clients` under tests/. With
# FASTAMP_REQUIRE_CLIENTS=1 a skipped `clients` test fails (tests/conftest.py), so a missing or
# broken client cannot pass silently.
CLIENTS_VENV := $(VENV)-clients

test-clients: $(VENV)/.built
	$(MAKE) $(CLIENTS_VENV)/.deps VENV=$(CLIENTS_VENV) EXTRA_DEPS="-r requirements/clients.txt"
	$(CLIENTS_VENV)/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '$(patsubst torch==%,%,$(TORCH_SPEC))', torch.__version__"
	$(PY) .ci/share_build.py $(CLIENTS_VENV)/bin/python
	FASTAMP_REQUIRE_CLIENTS=1 $(TEST_ENV) $(CLIENTS_VENV)/bin/python -m pytest -q -m clients $(XDIST) $(PYTEST_ARGS)

# The torch version matrix: the CPU wheel of `make wheel` (one file, compiled once against the
# stable ABI of torch 2.11) installed beside each release in MATRIX (PyPI's CUDA wheels, run on the
# CPU; PIP_CONSTRAINT=/dev/null lifts this machine's pip cap at 2.14.1), then the CPU suites.
# Results: benchmarks/results/torch_matrix.md.
MATRIX ?= 2.11.0 2.12.0 2.13.0 2.14.1 2.15.0
MATRIX_TESTS ?= tests/scaler tests/optim tests/checkpoint tests/parallel tests/resume tests/toolkit tests/test_library.py tests/test_torch_contract.py tests/test_architecture.py

test-matrix: dist/cpu/.built
	@for v in $(MATRIX); do \
	  echo "=== torch $$v, with $$(ls dist/cpu/*.whl) ==="; \
	  [ -f .venv-torch$$v/.deps ] || PIP_CONSTRAINT=/dev/null $(MAKE) --no-print-directory .venv-torch$$v/.deps \
	    VENV=.venv-torch$$v TORCH_SPEC=torch==$$v || exit 1; \
	  .venv-torch$$v/bin/python -m pip install -q --no-deps --force-reinstall dist/cpu/*.whl || exit 1; \
	  (cd tests && ../.venv-torch$$v/bin/python -c "import fastamp, torch; print('torch', torch.__version__, 'fastamp from', fastamp.__file__)") || exit 1; \
	  .venv-torch$$v/bin/python -m pytest -q -p no:cacheprovider $(MATRIX_TESTS) $(PYTEST_ARGS) || exit 1; \
	done

# CI's slice of the matrix: the floor and the newest torch, each beside .venv's compiled library
# (copied, not rebuilt: .ci/share_build.py), running the suites that follow torch's internals.
MATRIX_CI ?= 2.11.0 2.15.0
# The suites where torch's versions differ: loading, the privates contract, the GradScaler and
# optimizer differentials against torch's classes, DDP's constructor and hooks against torch's, the
# Python-defined RNG ops. (The whole CPU matrix is `make test-matrix`, about 10 minutes a release.)
# DDP's parity with torch's runs at 2 ranks here (make test-all: 2 and 3): about 2.5 minutes less
# per release on 2 cores, for differences between torch versions, not between rank counts.
MATRIX_CI_TESTS ?= tests/test_library.py tests/test_torch_contract.py tests/scaler/test_grad_scaler.py tests/scaler/test_scaler_fidelity.py tests/scaler/test_misuse.py tests/optim/test_optimizers.py tests/optim/test_optim_fidelity.py tests/parallel/test_ddp_parity.py tests/checkpoint/test_checkpoint_ops.py

test-matrix-ci: $(VENV)/.built
	@for v in $(MATRIX_CI); do \
	  echo "=== torch $$v, beside .venv's compiled library ==="; \
	  [ -f .venv-torch$$v/.deps ] || PIP_CONSTRAINT=/dev/null $(MAKE) --no-print-directory .venv-torch$$v/.deps \
	    VENV=.venv-torch$$v TORCH_SPEC=torch==$$v || exit 1; \
	  $(PY) .ci/share_build.py .venv-torch$$v/bin/python || exit 1; \
	  FASTAMP_DDP_PARITY_WORLDS=2 $(TEST_ENV) .venv-torch$$v/bin/python -m pytest -q -p no:cacheprovider $(XDIST) $(MATRIX_CI_TESTS) $(PYTEST_ARGS) || exit 1; \
	done

# Release artefacts, in dist/: a CPU wheel (built in .venv), a CUDA wheel (built in .venv-cuda with
# nvcc, the default arch list) and the sdist. The wheels' versions carry their flavour as torch's do
# (0.1.0+cpu, 0.1.0+cu130: cmake/wheel_flavour.py), so their file names differ and one index holds
# both; the sdist has none (FASTAMP_VERSION_LABEL empty), as a wheel built from it keeps its version. Each wheel is Python abi3 and loads on every torch
# from 2.11 up (LibTorch stable ABI); auditwheel repairs it to manylinux_2_28 (WHEEL_PLAT), leaving
# out the libraries torch itself provides; .ci/check_library.py audits the library inside and the
# wheel (auditwheel show --json: symbols within manylinux_2_28, nothing from outside but torch's
# libraries). The reports go to dist/wheels.txt (copied into benchmarks/results/wheels.md by hand
# with the matrix results).
WHEEL_EXCLUDE := --exclude libtorch_cpu.so --exclude libtorch_cuda.so --exclude 'libcudart.so.*'
# The oldest platform torch's own wheels support (glibc 2.28); repair fails, naming the symbol, if
# the library needs a newer glibc or libstdc++ (csrc/common/manylinux_compat.cpp keeps builds with
# this project's GCC 12 / glibc 2.36 within it).
WHEEL_PLAT := manylinux_2_28_x86_64

# The CPU wheel compiles in its own tree, build/wheel-cpu (kept: a second `make wheel-cpu`
# recompiles only what changed), not in the editable install's build/$(VENV): that tree is
# configured for an editable install with .venv's torch's CUDA setting (a CUDA torch builds the
# CUDA kernels there), and building the wheel in it would reconfigure it both ways on every switch
# between `make test` and `make wheel-cpu`. The first wheel build compiles every object once more.
dist/cpu/.built: $(VENV)/.deps pyproject.toml CMakeLists.txt $(shell find csrc cmake python -type f -not -name '*.pyc' 2>/dev/null)
	rm -rf dist/cpu dist/raw-cpu && mkdir -p dist build
	@echo "compiling the CPU wheel in build/wheel-cpu (its own tree: see the Makefile; a few minutes the first time, then only what changed; full log: build/wheel-cpu.log) ..."
	@set -o pipefail; FASTAMP_CUDA=OFF FASTAMP_WERROR=ON $(PIP) wheel -v --no-build-isolation --no-deps -w dist/raw-cpu . -Cbuild-dir=build/wheel-cpu 2>&1 \
	  | tee build/wheel-cpu.log | { grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\]|-- fastamp:|ninja: no work to do' || true; } \
	  || { grep -E -A8 'CMake Error|error:|FAILED:' build/wheel-cpu.log | head -80; \
	       echo "fastamp: the wheel build failed; full log: build/wheel-cpu.log"; exit 1; }
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/auditwheel repair --plat $(WHEEL_PLAT) $(WHEEL_EXCLUDE) -w dist/cpu dist/raw-cpu/*.whl
	rm -rf dist/raw-cpu
	touch $@

# CUDA_VENV: any venv with a CUDA torch >= 2.11 and the build tools (default: the cuda-build one).
CUDA_VENV ?= $(VENV)-cuda
dist/cuda/.built: $(shell find csrc cmake python -type f -not -name '*.pyc' 2>/dev/null)
	[ -x $(CUDA_VENV)/bin/python ] || $(MAKE) $(CUDA_VENV)/.deps VENV=$(CUDA_VENV) TORCH_SPEC=torch==2.14.1
	rm -rf dist/cuda dist/raw-cuda && mkdir -p dist
	PATH="/usr/local/cuda/bin:$$PATH" FASTAMP_CUDA=ON FASTAMP_WERROR=ON $(CUDA_VENV)/bin/python -m pip wheel -q --no-build-isolation --no-deps \
	  -w dist/raw-cuda . -Cbuild-dir=build/wheel-cuda
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/auditwheel repair --plat $(WHEEL_PLAT) $(WHEEL_EXCLUDE) -w dist/cuda dist/raw-cuda/*.whl
	rm -rf dist/raw-cuda
	touch $@

wheel-cpu: dist/cpu/.built
	{ w=$$(ls dist/cpu/*.whl); echo "### $$w"; $(VENV)/bin/auditwheel show $$w; \
	  $(PY) .ci/check_library.py dist/cpu; } 2>&1 | tee dist/wheels-cpu.txt
	@ls -l dist/cpu/*.whl

wheel: dist/cpu/.built dist/cuda/.built
	rm -f dist/*.tar.gz && FASTAMP_VERSION_LABEL= $(PY) -m build --sdist --no-isolation -o dist . > /dev/null
	{ for w in dist/cpu/*.whl dist/cuda/*.whl; do echo "### $$w"; $(VENV)/bin/auditwheel show $$w; done; \
	  $(PY) .ci/check_library.py dist/cpu dist/cuda; } 2>&1 | tee dist/wheels.txt
	@ls -l dist/*.tar.gz dist/cpu/*.whl dist/cuda/*.whl

bench: $(VENV)/.built
	$(PY) benchmarks/scaler/bench_grad_scaler.py
	$(PY) benchmarks/optim/bench_optim_step.py
	$(PY) benchmarks/checkpoint/bench_checkpoint.py

# The GPU tier (.ci/gpu_check.sh; docs/reliability.md): on a CUDA machine, the CUDA kernels against
# the CPU kernels bit for bit, the CUDA tests, measured DRAM traffic (ncu) and the GPU benchmarks;
# without a GPU it runs up to the first step that needs one and says what it skipped.
gpu-check: dist/cuda/.built
	PY=$(CUDA_VENV)/bin/python bash .ci/gpu_check.sh dist/cuda/*.whl

# Registers, spills, shared memory and theoretical occupancy of every CUDA kernel for sm_80/86/90,
# from ptxas -v with the CUDA build's own flags (.ci/gpu_resources.py); writes docs/gpu_resources.md
# and fails on a spill or an occupancy under the floor. Needs the CUDA build (make cuda-build).
CUDA_BUILD ?= build/$(notdir $(VENV))-cuda
gpu-resources:
	PATH="/usr/local/cuda/bin:$$PATH" $(PY) .ci/gpu_resources.py --build $(CUDA_BUILD) --markdown docs/gpu_resources.md --check

# Global-memory traffic of every CUDA kernel under the emulator (requests, 32-byte sectors,
# coalescing, DRAM bytes per element vs the model) and the GPU step it predicts vs torch's recipe:
# docs/gpu_traffic.md; fails when a kernel departs from its model. No GPU needed.
gpu-traffic: emu
	$(PY) benchmarks/gpu/emulated_traffic.py --markdown docs/gpu_traffic.md --check

# Mutation testing of the CUDA kernels (tests/cuda_emu/mutate.py): MUTATE_PER_FILE generated
# mutants from each CUDA source and shared math header, each built into its own emulator library
# and run against its file's emulated tests; the results go to benchmarks/results/mutation_cuda.md.
MUTATE_PER_FILE ?= 17
mutate: emu
	$(PY) tests/cuda_emu/mutate.py --per-file $(MUTATE_PER_FILE) --state build/mutate_state.json \
	  --out benchmarks/results/mutation_cuda.md

# The CPU kernels' and the Python step logic's mutation tiers write each mutant over its file,
# so each runs in its own worktree of HEAD (build/mutate-{cpu,python}-wt) with this venv's
# compiled library copied in: commit first. Results: benchmarks/results/mutation_{cpu,python}.md,
# and a cache of outcomes in build/ (a mutant is re-run when its file or its tests change).
MUTATE_CPU_PER_FILE ?= 6
MUTATE_PY_PER_FILE ?= 3
# MUTATE_PY_MINUTES=N: start no mutant after N minutes (the report says how many have no outcome)
MUTATE_PY_MINUTES ?=
define mutate_worktree
	git worktree remove --force $(1) 2>/dev/null || rm -rf $(1)
	git worktree prune
	git worktree add --force --detach $(1) HEAD
	$(PY) -c 'import fastamp, os, shutil; d = os.path.dirname(fastamp._C.__file__); [shutil.copy2(os.path.join(d, f), "$(1)/python/fastamp/") for f in ("_C.abi3.so", "_build_info.py")]'
endef
mutate-cpu: $(VENV)/.built
	$(call mutate_worktree,build/mutate-cpu-wt)
	cd build/mutate-cpu-wt && $(abspath $(PY)) tests/mutate_cpu.py --per-file $(MUTATE_CPU_PER_FILE) \
	  --state $(CURDIR)/build/mutate_cpu_state.json --out $(CURDIR)/benchmarks/results/mutation_cpu.md
mutate-python: $(VENV)/.built
	$(call mutate_worktree,build/mutate-python-wt)
	cd build/mutate-python-wt && $(abspath $(PY)) tests/mutate_python.py --per-file $(MUTATE_PY_PER_FILE) \
	  $(if $(MUTATE_PY_MINUTES),--minutes $(MUTATE_PY_MINUTES),) \
	  --state $(CURDIR)/build/mutate_python_state.json --out $(CURDIR)/benchmarks/results/mutation_python.md

# CI's fixed sample: one killed mutant of each .cu file (seconds each; all must stay killed).
MUTATE_CI_KEYS := 7adc659ec5 48db2909fa b076a08aa4 d46b6b829d e35257f87f
mutate-sample: emu
	$(PY) tests/cuda_emu/mutate.py --keys $(MUTATE_CI_KEYS) --min-score 100

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
	$(ASAN_PY) -m pip install -q "$(TORCH_SPEC)" $(BUILD_TOOLS) numpy pytest pytest-xdist==3.8.0 expecttest hypothesis
	touch $@

# Non-editable, so the Python sources are inputs too (and this Makefile: it holds the sanitizer list).
$(ASAN_VENV)/.built: $(ASAN_VENV)/.deps Makefile pyproject.toml CMakeLists.txt $(shell find csrc cmake python -type f -not -name '*.pyc' 2>/dev/null)
	FASTAMP_CUDA=OFF $(ASAN_PY) -m pip install -q --no-build-isolation --no-deps --force-reinstall . \
	  -Cbuild-dir=build/asan -Cinstall.strip=false \
	  -Ccmake.define.FASTAMP_SANITIZE="address;undefined;float-cast-overflow" -Ccmake.define.FASTAMP_WERROR=ON
	touch $@

sanitize: $(ASAN_VENV)/.built
	tests/sanitize/run.sh $(ASAN_PY)

# Style held by CI: ruff's formatter (100 columns) and linter (E501 at 120 for the strings and
# comments a formatter cannot wrap), clang-format (.clang-format) over csrc/, then mypy, strict over
# python/fastamp ([tool.mypy] in pyproject.toml; it reads torch's annotations from this venv), held
# by a ratchet: the errors left per file (.ci/mypy_baseline.json) may only go down.
# `make format` applies the formatters. .pre-commit-config.yaml runs these same commands.
LINT_PY_DIRS := python tests benchmarks examples
CSRC_FILES = $(shell find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' \))

$(VENV)/.lint: requirements/lint.txt | $(VENV)/.deps
	$(PIP) install -q -r requirements/lint.txt
	touch $@

lint: $(VENV)/.lint
	$(VENV)/bin/ruff format --check $(LINT_PY_DIRS)
	$(VENV)/bin/ruff check $(LINT_PY_DIRS)
	$(VENV)/bin/clang-format --dry-run -Werror $(CSRC_FILES)
	$(PY) .ci/mypy_ratchet.py

format: $(VENV)/.lint
	$(VENV)/bin/ruff format $(LINT_PY_DIRS)
	$(VENV)/bin/clang-format -i $(CSRC_FILES)

clean:
	rm -rf build $(VENV) $(VENV)-cuda $(VENV)-asan $(VENV)-clients .venv-torch*
