"""Loading the compiled library: build info, the torch-version guard, the error classes."""

import subprocess
import sys
import textwrap

import pytest
import torch

import fastamp
from fastamp._library import StableOps, _release, check_torch_version, translate_error


def test_build_info_reports_versions_and_kernels():
    info = fastamp.build_info()
    # One library for every torch from its stable-ABI target up: the torch it was compiled with
    # need not be the running one, the target must not be newer.
    assert info["torch_target"] == "2.11"
    assert _release(info["torch_target"]) <= _release(torch.__version__)
    assert info["with_cuda"] in (True, False)
    if info["with_cuda"]:
        assert info["cuda_archs"], "a CUDA build must list the archs it was built for"
    for op, keys in info["ops"].items():
        assert "CPU" in keys, op


def _import_with_build_info(**fields: str) -> str:
    """Imports fastamp in a fresh interpreter whose build-info module has ``fields`` replaced."""
    code = textwrap.dedent(
        f"""
        import importlib.util, os, sys, types
        # The real build info, read without importing fastamp (whose import would load it).
        pkg = importlib.util.find_spec("fastamp").submodule_search_locations[0]
        fake = types.ModuleType("fastamp._build_info")
        with open(os.path.join(pkg, "_build_info.py")) as f:
            exec(f.read(), fake.__dict__)
        fake.__dict__.update({fields!r})
        sys.modules["fastamp._build_info"] = fake
        try:
            import fastamp
        except ImportError as e:
            print("IMPORTERROR:", e)
        else:
            print("IMPORTED", fastamp.build_info()["torch_version"])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_import_refuses_a_torch_older_than_the_target_with_both_versions_and_the_fix():
    msg = _import_with_build_info(TORCH_TARGET="9.99")
    assert "IMPORTERROR:" in msg, msg
    assert "torch 9.99 or newer" in msg and torch.__version__ in msg
    assert "pip install --no-build-isolation" in msg


def test_import_accepts_a_library_compiled_with_another_torch():
    # The point of the stable ABI: a wheel compiled with one torch loads beside another.
    msg = _import_with_build_info(TORCH_VERSION="2.99.0+other")
    assert "IMPORTED 2.99.0+other" in msg, msg


def test_check_torch_version_compares_releases_not_strings():
    check_torch_version("2.11", "2.11.0+cpu")
    check_torch_version("2.11", "2.15.0.dev20261101+cu132")
    check_torch_version("2.9", "2.10.0")  # 10 > 9 as numbers, not as strings
    with pytest.raises(ImportError, match="needs torch 2.11 or newer"):
        check_torch_version("2.11", "2.10.1")


@pytest.mark.parametrize("cls", [TypeError, ValueError, NotImplementedError])
def test_a_kernels_marked_error_reaches_python_as_its_class(cls):
    err = translate_error(RuntimeError(f"{cls.__name__}: fastamp::op: x is wrong"))
    assert type(err) is cls and str(err) == "fastamp::op: x is wrong"
    plain = RuntimeError("fastamp::op: y is wrong")
    assert translate_error(plain) is plain
    subclass = NotImplementedError("TypeError: not ours to rename")
    assert translate_error(subclass) is subclass


def test_the_raw_op_raises_the_class_a_kernel_meant_and_so_do_the_wrappers():
    """The dispatcher kernel at ADInplaceOrView translates a marked error for the raw op; under
    inference_mode (no such key) the raw op keeps the marked RuntimeError and the wrappers
    translate it."""
    bad_inv = torch.ones((), dtype=torch.float64)
    bucket, grads = torch.zeros(4), [torch.ones(4)]
    with pytest.raises(TypeError, match=r"^fastamp::bucket_unpack_: inv_scale has dtype Double"):
        torch.ops.fastamp.bucket_unpack_(bucket, grads, [0], bad_inv)
    with pytest.raises(TypeError, match=r"^fastamp::bucket_unpack_: inv_scale has dtype Double"):
        StableOps("fastamp").bucket_unpack_(bucket, grads, [0], bad_inv)
    with pytest.raises(NotImplementedError, match=r"grads\[0\] has dtype Long"):
        torch.ops.fastamp.grad_stats([torch.ones(3, dtype=torch.long)], torch.ones(()))
    with pytest.raises(NotImplementedError, match=r"grads\[0\] has dtype Long"):
        fastamp.scaler._ops.grad_stats([torch.ones(3, dtype=torch.long)], torch.ones(()))
    with torch.inference_mode():
        bucket, grads, bad_inv = torch.zeros(4), [torch.ones(4)], bad_inv.clone()
        with pytest.raises(RuntimeError, match=r"^TypeError: fastamp::bucket_unpack_: inv_scale"):
            torch.ops.fastamp.bucket_unpack_(bucket, grads, [0], bad_inv)
        with pytest.raises(TypeError, match=r"^fastamp::bucket_unpack_: inv_scale has dtype"):
            StableOps("fastamp").bucket_unpack_(bucket, grads, [0], bad_inv)
