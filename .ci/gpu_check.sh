#!/usr/bin/env bash
# The GPU tier (`make gpu-check`): everything fastamp can check on a CUDA machine, in one command.
#
#   bash .ci/gpu_check.sh [WHEEL]      PY=python of a CUDA torch (default python3)
#                                      OUT=results folder (default build/gpu-check)
#                                      DEADLINE=seconds for the whole run (default 1500)
#                                      TAR=where the packed results go (default $OUT/results.tar.gz)
#
# 1. env      the torch, the GPU, fastamp's build (installs WHEEL into a private folder if given)
# 2. doctor   python -m fastamp doctor (its self-tests run every op on each device it has)
# 3. bitwise  the emulator's differential tests with FASTAMP_EMU_DEVICE=cuda: every CUDA kernel
#             on the GPU against the CPU kernel, bit for bit (reductions within float64 tolerance),
#             canaries around every tensor, each case three times (a run-to-run difference fails)
# 4. tests    the test suite's CUDA-marked tests (the classes on CUDA tensors, opcheck, compile)
# 5. bench    the optimizer-step, scaler and scaler-free (bf16) benchmarks on the GPU, torch
#             beside fastamp
# 6. traffic  one post-backward step (torch's recipe; fastamp's with fp32, bf16 and int8 state)
#             under Nsight Compute: DRAM bytes read + written per parameter, measured
# 7. bench    torch.profiler over one step; the checkpoint benchmark
# (in this order: when the deadline is near, the later stages are skipped and say so)
# Without a GPU (or with GPU_CHECK_DRY=1) it runs 1-2, collects the tests of 3-4 and checks the
# scripts of 5-7 parse their arguments, and says what it skipped. A failed stage does not stop
# the later ones; the exit status is non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-build/gpu-check}
DEADLINE=${DEADLINE:-1500}
WHEEL=${1:-}
mkdir -p "$OUT"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
failed=0

note() { echo "$*" | tee -a "$SUMMARY"; }
TAR=${TAR:-$OUT/results.tar.gz}
pack() { tar -czf "$TAR.tmp" -C "$OUT" --exclude='results.tar.gz*' . 2>/dev/null && mv "$TAR.tmp" "$TAR"; }
# stage NAME LIMIT CMD...: runs CMD with a limit of min(LIMIT, what is left of DEADLINE), logs it
# to $OUT/NAME.log and records the outcome.
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - ($(date +%s) - START) - 5))
  if ((left < 10)); then
    note "SKIPPED $name: the run's deadline (${DEADLINE}s) is spent"
    failed=1
    return
  fi
  ((limit > left)) && limit=$left
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout --kill-after=5 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  local dt=$(($(date +%s) - t0))
  if ((rc == 0)); then
    note "PASSED  $name (${dt}s)"
  else
    note "FAILED  $name (rc $rc, ${dt}s$( ((rc == 124 || rc == 137)) && echo ", over its limit"))"
    failed=1
  fi
  pack
}

if [ -n "$WHEEL" ]; then
  SITE=$(mktemp -d)
  trap 'rm -rf "$SITE"' EXIT
  "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "$WHEEL" || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

HAS_GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
[ "${GPU_CHECK_DRY:-0}" = 1 ] && HAS_GPU=0

stage env 60 "$PY" - <<'EOF'
import json, platform, subprocess, sys
import torch, fastamp
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("fastamp", fastamp.__file__)
print(json.dumps(fastamp.build_info(), indent=1, default=str))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
          f"{p.total_memory / 2**30:.0f} GiB")
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
else:
    print("no CUDA device")
EOF
stage doctor 120 "$PY" -m fastamp doctor

XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${GPU_CHECK_JOBS:-8}")
# Two threads a worker: eight workers of 16 OpenMP threads each took the bitwise tier from 27 s to
# over 150 s on a 16-core machine.
PYTEST=(env OMP_NUM_THREADS=2 "$PY" -m pytest -q -p no:cacheprovider -o addopts="-m 'not slow'" -ra)

if [ "$HAS_GPU" = 1 ]; then
  stage bitwise 150 env FASTAMP_EMU_DEVICE=cuda "${PYTEST[@]}" "${XDIST[@]}" tests/cuda_emu \
    --junitxml="$OUT/bitwise.xml"
  stage tests 180 "${PYTEST[@]}" "${XDIST[@]}" -m "cuda and not slow" tests --ignore=tests/cuda_emu \
    --junitxml="$OUT/tests.xml"
  stage bench-optim 150 "$PY" benchmarks/optim/bench_optim_step.py --device cuda \
    --sizes 10e6 100e6 500e6 --json "$OUT/optim_cuda.json"
  stage bench-scaler-fp32 120 "$PY" benchmarks/scaler/bench_grad_scaler.py --device cuda \
    --sizes 10e6 100e6 500e6 --json "$OUT/scaler_cuda_float32.json"
  # The scaler-free (bf16 autocast) step: torch's clip + AdamW(fused=True) vs fastamp's, wall and
  # kernel time at 10M params in 25 tensors and 100M in 121, and the host cost per tensor.
  stage bench-bf16 150 "$PY" benchmarks/optim/bench_bf16_step.py --device cuda --sizes \
    --layouts 10e6/25 100e6/121 --flat --guard --json "$OUT/bf16_cuda.json"
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1 || true)
  if [ -n "$NCU" ]; then
    mkdir -p "$OUT/traffic"
    for rs in torch:float32 fastamp:float32 fastamp:bfloat16 fastamp:int8; do
      stage "traffic-${rs/:/-}" 60 "$NCU" --profile-from-start off --clock-control none \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum --csv --page raw --print-units base \
        --log-file "$OUT/traffic/${rs/:/-}.csv" \
        "$PY" benchmarks/gpu/step_traffic.py --recipe "${rs%%:*}" --state "${rs##*:}"
    done
    BW=$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from common import copy_bandwidth; print(copy_bandwidth('cuda'))")
    stage traffic-summary 60 "$PY" benchmarks/gpu/step_traffic.py --summarize "$OUT/traffic" \
      --bandwidth "${BW:-0}" --json "$OUT/traffic.json"
  else
    note "SKIPPED traffic: no Nsight Compute (ncu) on this machine"
  fi
  # fp32 grads only: torch's GradScaler refuses fp16 grads ("Attempting to unscale FP16
  # gradients") and cannot unscale bf16 ones on CUDA (NotImplementedError, torch 2.11), so there is
  # no torch recipe to compare a half-precision-grad run with on a GPU.
  stage profile 150 "$PY" benchmarks/gpu/profile_step.py --numel 10e6 100e6 --flat
  stage bench-checkpoint 120 "$PY" benchmarks/checkpoint/bench_checkpoint.py --device cuda \
    --json "$OUT/checkpoint_cuda.json"
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if ((NGPU >= 2)); then
    stage bench-ddp 300 "$PY" -m torch.distributed.run --nproc-per-node 2 \
      benchmarks/distributed/bench_ddp.py --json "$OUT/ddp_cuda.json"
  else
    note "SKIPPED bench-ddp: needs 2 GPUs, this machine has $NGPU"
  fi
else
  note "no CUDA device: what follows is collected and parsed, not run"
  stage bitwise-collect 120 env FASTAMP_EMU_DEVICE=cuda "${PYTEST[@]}" --collect-only tests/cuda_emu
  stage tests-collect 120 "${PYTEST[@]}" --collect-only -m "cuda and not slow" tests --ignore=tests/cuda_emu
  for b in gpu/step_traffic gpu/profile_step scaler/bench_grad_scaler optim/bench_optim_step optim/bench_bf16_step checkpoint/bench_checkpoint; do
    stage "parse-${b##*/}" 60 "$PY" "benchmarks/$b.py" --help
  done
  note "SKIPPED (no CUDA device): bitwise (GPU vs CPU kernels), tests (-m cuda), traffic (ncu),"
  note "        bench-scaler, bench-optim, bench-bf16, bench-checkpoint, bench-ddp"
fi
note "gpu-check: $( ((failed)) && echo FAILED || echo passed) in $(($(date +%s) - START))s; results in $OUT"
pack
exit $failed
