"""Prints, as CMake `set()` lines, what the build needs from the installed torch.

Run by CMakeLists.txt with the interpreter that will import fastamp, so the extension is always
compiled against the torch it will load with.
"""

import os
import sys


def _isolated_build() -> bool:
    """True when a PEP 517 front end runs us in a throw-away build environment (pip's
    pip-build-env-*, pypa/build's build-env-*, uv's builds-v0): the torch the user installed is
    then invisible, whatever they installed."""
    markers = ("pip-build-env-", "build-env-", "builds-v0")
    where = [sys.prefix, os.environ.get("PYTHONPATH", ""), *sys.path]
    return any(m in p for p in where for m in markers)


try:
    import torch
    from torch.utils import cpp_extension
except Exception as exc:  # pragma: no cover - exercised only on broken environments
    if _isolated_build():
        sys.stderr.write(
            "fastamp: build isolation is on, so this build cannot see your installed torch "
            f"(the isolated build environment hides it: {exc}).\n"
            "fastamp compiles against the torch it will run with. Build with\n"
            "    pip install --no-build-isolation .      (or: pip install --no-build-isolation -e .)\n"
            "after `pip install scikit-build-core cmake ninja` (and torch, if not yet installed).\n"
        )
    else:
        sys.stderr.write(
            f"fastamp: cannot import torch in {sys.executable}: {exc}\n"
            "Install torch first (pip install torch), then build fastamp with "
            "`pip install --no-build-isolation .`\n"
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
