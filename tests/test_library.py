"""Loading the compiled library: build info and the torch-version guard."""

import subprocess
import sys
import textwrap

import torch

import fastamp


def test_build_info_reports_versions_and_kernels():
    info = fastamp.build_info()
    assert info["torch_version"] == torch.__version__
    assert info["with_cuda"] in (True, False)
    if info["with_cuda"]:
        assert info["cuda_archs"], "a CUDA build must list the archs it was built for"
        assert info["torch_cuda_version"] == torch.version.cuda
    for op, keys in info["ops"].items():
        assert "CPU" in keys, op


def test_import_refuses_a_different_torch_with_both_versions_and_the_fix():
    # Simulate a build made for another torch by substituting the build-info module before import.
    code = textwrap.dedent(
        """
        import sys, types
        fake = types.ModuleType("fastamp._build_info")
        fake.TORCH_VERSION = "1.99.0+fake"
        sys.modules["fastamp._build_info"] = fake
        try:
            import fastamp
        except ImportError as e:
            print("IMPORTERROR:", e)
        else:
            print("IMPORTED")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "IMPORTERROR:" in out.stdout, out.stdout + out.stderr
    msg = out.stdout
    assert "1.99.0+fake" in msg and torch.__version__ in msg
    assert "pip install --no-build-isolation" in msg


def test_check_torch_version_accepts_the_same_version():
    from fastamp._library import check_torch_version

    check_torch_version(torch.__version__, torch.__version__)
