"""CI check of the CUDA flavour: imports the CUDA build (no GPU needed) and asserts every op has a
CUDA kernel registered next to its CPU kernel."""

import sys

import torch

import fastamp

info = fastamp.build_info()
print(info)
problems = []
if not torch.version.cuda:
    problems.append(f"torch {torch.__version__} is not a CUDA build")
if not info["with_cuda"]:
    problems.append("fastamp was built without CUDA kernels")
if not info["cuda_archs"]:
    problems.append("no CUDA archs recorded in build info")
for op, keys in info["ops"].items():
    for key in ("CPU", "CUDA"):
        if key not in keys:
            problems.append(f"fastamp::{op} has no {key} kernel (has {keys})")
if problems:
    print("CUDA build check FAILED:\n  " + "\n  ".join(problems))
    sys.exit(1)
print(f"CUDA build check OK: {len(info['ops'])} ops with CPU+CUDA kernels, archs {info['cuda_archs']}")
