#!/usr/bin/env bash
# Runs fastamp's tests against a build with -DFASTAMP_SANITIZE="address;undefined;..."
# (`make sanitize` builds one into .venv-asan and calls this) and fails on any sanitizer report.
#
#   tests/sanitize/run.sh PYTHON [pytest paths/args...]     (default: the passes of step 2)
#
# 1. Self-test: in a subprocess per kind, fastamp::_sanitizer_selftest (compiled only into
#    sanitized builds) does a heap overflow / signed overflow / misaligned load on purpose; each
#    subprocess must die with that report. If one does not, reports are not reaching us and "zero
#    reports" below would mean nothing, so the script fails.
# 2. pytest with the same environment; spawned subprocesses (the gloo workers of the distributed
#    tests, the per-ISA kernel check) inherit it and log into the same folder.
# 3. Fails if pytest fails or any sanitizer report was written; prints
#    "sanitize: N tests (...), 0 sanitizer reports".
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:?usage: tests/sanitize/run.sh PYTHON [pytest args...]}
shift
LOG_DIR=${SANITIZE_LOG_DIR:-build/asan-logs}
LOG_DIR=$(mkdir -p "$LOG_DIR" && cd "$LOG_DIR" && pwd)
rm -rf "${LOG_DIR:?}"/*

# Where the module lives, found without importing it (an ASan-instrumented library cannot be
# loaded before the ASan runtime is preloaded).
so=$("$PY" - <<'EOF'
import glob, importlib.util, os
spec = importlib.util.find_spec("fastamp")
paths = [p for d in spec.submodule_search_locations for p in glob.glob(os.path.join(d, "_C*.so"))]
print(paths[0] if paths else "")
EOF
)
[ -n "$so" ] || { echo "sanitize: fastamp._C not found for $PY" >&2; exit 1; }
# The python and torch that load us are not instrumented, so ASan's runtime has to come first in
# the process: preload exactly the libasan the module was linked against.
# libstdc++ is preloaded too: python does not link it, so when ASan initialises its __cxa_throw
# interceptor finds no real __cxa_throw, and the first C++ exception (every TORCH_CHECK that a test
# expects to fail) dies with "CHECK failed: ... real___cxa_throw != 0".
asan_rt=$(ldd "$so" | awk '/libasan\.so/ {print $3}')
cxx_rt=$(ldd "$so" | awk '/libstdc\+\+\.so/ {print $3}')
[ -n "$asan_rt" ] || { echo "sanitize: $so is not linked against libasan (not a sanitized build?)" >&2; exit 1; }
export LD_PRELOAD="$asan_rt${cxx_rt:+:$cxx_rt}${LD_PRELOAD:+:$LD_PRELOAD}"
# detect_leaks=0: CPython and torch keep their interned objects/registries until exit by design, so
# LeakSanitizer would report thousands of "leaks" that are not ours.
# Everything else stays at ASan's strict defaults (alloc_dealloc_mismatch, odr checks, ...): no
# false positive from torch's allocations has shown up, so nothing more is switched off.
ASAN_BASE="detect_leaks=0:halt_on_error=1:abort_on_error=0:symbolize=1"
export ASAN_OPTIONS="$ASAN_BASE:log_path=$LOG_DIR/asan"
# halt_on_error + -fno-sanitize-recover=all (CMake): the first UB report kills the process (exit
# code 1), so it cannot scroll by in a passing test.
# With GCC the UBSan handlers live in a separate runtime (libubsan.so.1) whose call to the exported
# __sanitizer_set_report_path binds to the preloaded libasan's copy, so UBSan ignores log_path and
# always writes to stderr (log_path is set anyway, for runtimes that honour it). Hence pytest runs
# with --capture=sys and its whole output, subprocesses' stderr included, is kept in pytest.log and
# searched for reports too.
UBSAN_BASE="halt_on_error=1:print_stacktrace=1:symbolize=1"
export UBSAN_OPTIONS="$UBSAN_BASE:log_path=$LOG_DIR/ubsan"
REPORT_RE='ERROR: AddressSanitizer|: runtime error: |SUMMARY: (Address|UndefinedBehavior)Sanitizer'

if command -v llvm-symbolizer >/dev/null 2>&1; then
  export ASAN_SYMBOLIZER_PATH=$(command -v llvm-symbolizer)
fi
# A crash in native code must be reported by ASan from the faulting instruction: Python's
# faulthandler (pytest turns it on) would catch SIGSEGV first and re-raise it, so ASan would only
# see the re-raise. Hence -p no:faulthandler, and -v so that the log names the test that crashed.
unset PYTHONFAULTHANDLER

# --- 1. the harness must be able to fail ----------------------------------------------------------
selftest() {  # kind, text the report must contain ("" = must run clean)
  local kind=$1 expect=$2 dir="$LOG_DIR/selftest-$1" rc=0
  mkdir -p "$dir"
  ASAN_OPTIONS="$ASAN_BASE:log_path=$dir/asan" UBSAN_OPTIONS="$UBSAN_BASE:log_path=$dir/ubsan" \
    "$PY" -c "import torch, fastamp; torch.ops.fastamp._sanitizer_selftest('$kind')" \
    >"$dir/stdout" 2>&1 || rc=$?
  local files
  files=$(find "$dir" -type f | sort)
  if [ -z "$expect" ]; then
    if [ "$rc" -ne 0 ] || [ "$(echo "$files" | wc -l)" -ne 1 ] || grep -Eq "$REPORT_RE" $files; then
      echo "sanitize: self-test '$kind' should run clean but exited $rc" >&2
      cat $files >&2
      return 1
    fi
  elif [ "$rc" -eq 0 ] || ! grep -q "$expect" $files; then
    echo "sanitize: HARNESS BROKEN: self-test '$kind' exited $rc without a '$expect' report" >&2
    cat $files >&2
    return 1
  fi
  echo "sanitize: self-test '$kind' ok (${expect:-clean run})"
}
selftest none ""
selftest address "AddressSanitizer: heap-buffer-overflow"
selftest undefined "runtime error: signed integer overflow"
selftest misaligned "runtime error: load of misaligned address"

# --- 2. the tests under the sanitizers ------------------------------------------------------------
# Default: the op tests (with the op fuzzers) and the public classes' differential tests,
# whose gloo workers run the bucket ops in spawned processes that inherit this environment; then
# the op tests again on the baseline (non-AVX2) copy of the CPU kernels, and the optimizer op tests
# on the AVX2 copy (on an AVX-512 machine the suite itself runs the AVX-512 copy; the SIMD loops
# of the low-precision state differ by width between the three). Not run here:
# tests/parallel/test_faults.py and test_fault_soak.py (they kill processes on purpose, so a
# sanitizer death there could pass as the injected fault) and tests/test_examples.py (the same
# ops through the same classes, for minutes more). Nor, as when they lived in tests/hardening, the
# misuse catalogue (tests/*/test_misuse*.py) and the aliasing tests (tests/*/test_*alias*.py).
OP_TESTS=(tests/scaler/test_ops.py tests/optim/test_optim_ops.py tests/optim/test_lowbit.py
  tests/optim/test_lowbit_sgd.py
  tests/checkpoint/test_checkpoint_ops.py tests/parallel/test_bucket_ops.py)
# The fuzzers (the public-API one too) and the >2^31-element tests: in both CPU passes.
OP_TESTS+=(tests/scaler/test_scaler_fuzz.py tests/optim/test_optim_fuzz.py
  tests/checkpoint/test_checkpoint_fuzz.py tests/parallel/test_bucket_fuzz.py
  tests/toolkit/test_public_api_fuzz.py
  tests/scaler/test_large_tensors.py tests/parallel/test_bucket_large.py)
CLASS_TESTS=(tests/scaler/test_grad_scaler.py tests/scaler/test_cpu_capabilities.py
  tests/optim/test_optimizers.py tests/optim/test_cpu_capabilities.py
  tests/checkpoint/test_checkpoint.py tests/parallel/test_ddp.py tests/test_library.py)
# tests/toolkit and tests/resume, less what is selected above or left out on purpose.
for f in tests/toolkit/test_*.py tests/resume/test_*.py; do
  case $f in */test_misuse*.py | */test_public_api_fuzz.py) ;; *) CLASS_TESTS+=("$f") ;; esac
done

# The CUDA emulator library with the same sanitizers (its objects are cached in build/cuda_emu/asan).
# Its fibers tell ASan about every stack switch, so the fibers' stacks are not reported.
emu_lib=$("$PY" tests/cuda_emu/build.py --sanitize | tail -n 1)
[ -f "$emu_lib" ] || { echo "sanitize: building the CUDA emulator library failed" >&2; exit 1; }
export FASTAMP_EMU_LIB=$emu_lib
# The emulator's self-tests, and one case family per op (every op and launcher path, not every
# dtype x size combination: the full set runs uninstrumented in step 1).
EMU_TESTS=(tests/cuda_emu/test_emulator.py tests/cuda_emu/test_emulated_ops.py tests/cuda_emu/test_emulated_lowbit.py
  -k "(lowbit and (fp16 or found_inf)) or (sgd_lowbit and bf16) or test_emulator or (grad_stats and 2.0) or non_finite or (clip_unscale and 10.0) or split or many or update_scale or (bucket and dtype0) or (digest and dtype0) or (adam_step and fp16) or (sgd_step and bf16) or found_inf")

# One pytest-xdist worker per core (SANITIZE_WORKERS; 1: one process), each test file in one
# worker, torch's waiting threads asleep rather than spinning (as make test runs its tiers). Each
# process writes its own sanitizer logs (log_path takes the pid), all read below.
WORKERS=${SANITIZE_WORKERS:-$(nproc 2>/dev/null || echo 1)}
XDIST=(-p no:xdist)
if [ "$WORKERS" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
  XDIST=(-n "$WORKERS" --dist loadfile)
  export OMP_WAIT_POLICY=passive
fi

rc=0
passes=()
run_pass() {  # name [VAR=value...] -- pytest args...
  local name=$1 envs=() r
  shift
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "sanitize: pass '$name': ${envs[*]} pytest $*"
  set +e
  env "${envs[@]}" "$PY" -m pytest -v -p no:cacheprovider -p no:faulthandler --capture=sys \
    "${XDIST[@]}" --junitxml="$LOG_DIR/$name.junit.xml" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  r=${PIPESTATUS[0]}
  set -e
  [ "$r" -eq 0 ] || rc=$r
  passes+=("$name")
}
if [ $# -gt 0 ]; then
  run_pass custom -- "$@"
else
  # The op and class tests of the quick tier: the full tier's extra cases of these files (DDP at 3
  # ranks, more sizes) reach the same kernels with other data, at twice the time under ASan.
  # (torch.compile's tests are not here: a compiled step calls the same kernels as the eager one,
  # and inductor's compile under ASan took 23 s.)
  run_pass suite -- -m "not slow and not full" "${OP_TESTS[@]}" "${CLASS_TESTS[@]}"
  run_pass emulated-cuda -- "${EMU_TESTS[@]}"
  run_pass ops-baseline-isa FASTAMP_CPU_CAPABILITY=default -- -m "not slow and not full" "${OP_TESTS[@]}"
  run_pass optim-avx2-isa FASTAMP_CPU_CAPABILITY=avx2 -- tests/optim/test_optim_ops.py \
    tests/optim/test_lowbit.py tests/optim/test_lowbit_sgd.py
fi

# --- 3. verdict -----------------------------------------------------------------------------------
# Each file an ASan/UBSan log_path produced is a report; so is each report in pytest's output.
reports=$(find "$LOG_DIR" -maxdepth 1 \( -name 'asan.*' -o -name 'ubsan.*' \) -size +0 | sort)
n_reports=$(printf '%s' "$reports" | grep -c . || true)
for f in $reports; do
  echo "=== sanitizer report: $f" >&2
  cat "$f" >&2
done
for name in "${passes[@]}"; do
  n=$(grep -Ec "ERROR: AddressSanitizer|: runtime error: " "$LOG_DIR/$name.log" || true)
  if [ "$n" -ne 0 ]; then
    echo "=== sanitizer reports in pytest's output ($LOG_DIR/$name.log):" >&2
    grep -E -A40 "$REPORT_RE" "$LOG_DIR/$name.log" >&2 || true
    n_reports=$((n_reports + n))
  fi
done
summary=$("$PY" - "$LOG_DIR" "${passes[@]}" <<'EOF'
import os, sys, xml.etree.ElementTree as ET
n = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
missing = []
for name in sys.argv[2:]:
    try:
        root = ET.parse(os.path.join(sys.argv[1], name + ".junit.xml")).getroot()
    except (OSError, ET.ParseError):
        missing.append(name)
        continue
    for s in root.iter("testsuite"):
        for k in n:
            n[k] += int(s.get(k, 0))
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
note = f"; no pytest report from pass {', '.join(missing)}: crashed?" if missing else ""
print(f"{n['tests']} tests ({passed} passed, {n['skipped']} skipped, "
      f"{n['failures'] + n['errors']} failed{note})")
EOF
)
echo "sanitize: $summary, $n_reports sanitizer reports (logs in $LOG_DIR)"
if [ "$rc" -ne 0 ] || [ "$n_reports" -ne 0 ]; then
  echo "sanitize: FAILED (pytest exit $rc, $n_reports sanitizer reports)" >&2
  exit 1
fi
