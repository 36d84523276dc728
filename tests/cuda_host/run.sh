#!/usr/bin/env bash
# Host-side checks of the CUDA multi-tensor-apply driver, for machines without a GPU: the launch
# packing (every chunk emitted once, in plan order, within the kernel-argument limits; tensors over
# 2^33 elements) and the per-thread chunk loop (every element visited once, same order aligned or
# not). Compiled with nvcc against the CUDA torch's headers; nothing here touches a GPU.
# Usage: tests/cuda_host/run.sh <python of a CUDA torch environment>
set -euo pipefail
PY=${1:?python of an environment with a CUDA build of torch}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
read -r std incs libdir < <("$PY" - <<'PYEOF'
import os, torch
from torch.utils import cpp_extension as ce
mm = tuple(int(x) for x in torch.__version__.split(".")[:2])
std = "c++20" if mm >= (2, 14) else "c++17"
print(std, ",".join(ce.include_paths()), os.path.join(os.path.dirname(torch.__file__), "lib"))
PYEOF
)
flags=(-std="$std" -O1 -DUSE_CUDA -I"$root/csrc" --expt-relaxed-constexpr -Xcompiler=-Wno-unused)
IFS=, read -ra inc_arr <<< "$incs"
for d in "${inc_arr[@]}"; do flags+=(-isystem "$d"); done
for t in test_mta_pack test_mta_chunk_loop; do
  nvcc "${flags[@]}" "$here/$t.cu" -o "$out/$t" -L"$libdir" -ltorch_cpu -ltorch_cuda -Xlinker -rpath="$libdir"
  echo "== $t"
  "$out/$t"
done
