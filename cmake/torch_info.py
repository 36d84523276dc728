"""Prints, as CMake `set()` lines, what the build needs from the installed torch.

Run by CMakeLists.txt with the interpreter that will import fastamp, so the extension is always
compiled against the torch it will load with.
"""

import os
import sys

try:
    import torch
    from torch.utils import cpp_extension
except Exception as exc:  # pragma: no cover - exercised only on broken environments
    sys.stderr.write(
        f"fastamp: cannot import torch in {sys.executable}: {exc}\n"
        "Install torch first, then build fastamp with `pip install --no-build-isolation .`\n"
    )
    sys.exit(1)


def cm(path: str) -> str:
    return path.replace("\\", "/")


lines: list[str] = []
print = lines.append  # noqa: A001  (collect the set() lines, then write them to argv[1])
torch_dir = os.path.dirname(torch.__file__)
print(f'set(FASTAMP_TORCH_VERSION "{torch.__version__}")')
print(f'set(FASTAMP_TORCH_CUDA_VERSION "{torch.version.cuda or ""}")')
print(f'set(FASTAMP_TORCH_CXX11_ABI "{int(torch._C._GLIBCXX_USE_CXX11_ABI)}")')
print(f'set(FASTAMP_TORCH_INCLUDE_DIRS "{";".join(cm(p) for p in cpp_extension.include_paths())}")')
print(f'set(FASTAMP_TORCH_LIB_DIR "{cm(os.path.join(torch_dir, "lib"))}")')
# The CUDA wheels ship CUDA headers/libraries as nvidia-* packages; offer them as fallbacks.
extra = []
try:
    import nvidia  # type: ignore

    for base in list(getattr(nvidia, "__path__", [])):
        for sub in sorted(os.listdir(base)):
            inc = os.path.join(base, sub, "include")
            if os.path.isdir(inc):
                extra.append(cm(inc))
except Exception:
    pass
print(f'set(FASTAMP_NVIDIA_WHEEL_INCLUDE_DIRS "{";".join(extra)}")')

with open(sys.argv[1], "w") as fh:
    fh.write("\n".join(lines) + "\n")
