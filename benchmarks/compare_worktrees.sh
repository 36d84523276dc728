#!/usr/bin/env bash
# Runs the scaler and optimizer benchmarks of two built checkouts alternately (before, after,
# before, after), so a change's effect on fastamp's speedup over PyTorch can be read against the
# run-to-run spread. Usage: benchmarks/compare_worktrees.sh BEFORE_DIR AFTER_DIR [ROUNDS]
# (each directory a checkout with its own built .venv).
set -euo pipefail
before=$1 after=$2 rounds=${3:-2}
for i in $(seq "$rounds"); do
  for side in before after; do
    d=$before; [ "$side" = after ] && d=$after
    (cd "$d" && .venv/bin/python benchmarks/scaler/bench_grad_scaler.py --sizes 10e6 50e6 --reps 7 2>&1 \
      | grep -E "^ +[0-9.]+M" | sed "s/^/scaler $side $i: /")
    (cd "$d" && .venv/bin/python benchmarks/optim/bench_optim_step.py --sizes 10e6 50e6 --reps 7 2>&1 \
      | grep -E "^ +[0-9.]+M" | sed "s/^/optim $side $i: /")
  done
done
