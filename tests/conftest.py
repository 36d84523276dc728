import pytest
import torch


def _devices():
    devs = ["cpu"]
    # No CUDA call at import time beyond is_available(), which does not initialise a context.
    devs.append(
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
            ],
        )
    )
    return devs


@pytest.fixture(params=_devices())
def device(request):
    if request.param == "cuda":
        import fastamp

        if not fastamp.build_info()["with_cuda"]:
            pytest.skip("fastamp was built without CUDA kernels")
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
