"""The environment check behind ``python -m fastamp doctor``.

Prints versions (torch, CUDA, cuDNN, NCCL), the GPUs with their compute capability, memory and
precision support, how fastamp was built, then runs every fastamp op on every available device
against its float64 reference. Exit status 0 when all is well, 1 otherwise, with the fix in words.
"""

from __future__ import annotations

import math
import platform
import traceback
from collections.abc import Callable

import torch
from torch import Tensor


class _Report:
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.problems: list[tuple[str, str]] = []

    def info(self, label: str, value: object) -> None:
        if not self.quiet:
            print(f"  {label:<28} {value}")

    def section(self, title: str) -> None:
        if not self.quiet:
            print(f"\n{title}")

    def problem(self, what: str, fix: str) -> None:
        self.problems.append((what, fix))
        print(f"  PROBLEM: {what}\n     fix: {fix}")


def _versions(r: _Report) -> None:
    r.section("environment")
    r.info("python", platform.python_version())
    r.info("torch", torch.__version__)
    r.info("CUDA (torch built with)", torch.version.cuda or "none (CPU build)")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    r.info("cuDNN", cudnn or "not available")
    nccl_built = _has_backend("nccl")
    nccl, backends = backend_lines(
        gloo_built=_has_backend("gloo"),
        nccl_built=nccl_built,
        nccl_version=_nccl_version() if nccl_built else None,
        cuda_available=torch.cuda.is_available(),
    )
    r.info("NCCL", nccl)
    r.info("distributed backends", backends)


def _has_backend(name: str) -> bool:
    import torch.distributed as dist

    return dist.is_available() and getattr(dist, f"is_{name}_available", lambda: False)()


def _nccl_version() -> str | None:
    # Reading the version of the NCCL torch was built with needs no GPU.
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        return None


def backend_lines(
    gloo_built: bool, nccl_built: bool, nccl_version: str | None, cuda_available: bool
) -> tuple[str, str]:
    """The doctor's "NCCL" and "distributed backends" values: what torch was built with, and which
    of those this machine can use (NCCL needs a CUDA device; a CUDA torch on a machine without a GPU
    has NCCL built in but cannot use it)."""
    if not nccl_built:
        nccl = "not in this torch build"
    elif cuda_available:
        nccl = nccl_version or "in this torch build"
    else:
        nccl = f"{nccl_version or 'in this torch build'}, not usable here (no CUDA device)"
    built = [name for name, b in (("gloo", gloo_built), ("nccl", nccl_built)) if b]
    if not built:
        return nccl, "none built into this torch"
    usable = [b for b in built if b != "nccl" or cuda_available]
    backends = f"built {', '.join(built)}; usable here {', '.join(usable) or 'none'}"
    if nccl_built and not cuda_available:
        backends += " (nccl needs a CUDA device)"
    return nccl, backends


def _gpus(r: _Report) -> None:
    r.section("devices")
    r.info("cpu", f"{platform.machine()}, {torch.get_num_threads()} threads")
    if not torch.cuda.is_available():
        r.info("cuda", "no GPU visible (CPU kernels only)")
        return
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        cc = f"{p.major}.{p.minor}"
        bf16 = torch.cuda.is_bf16_supported() if i == torch.cuda.current_device() else p.major >= 8
        r.info(
            f"cuda:{i}",
            f"{p.name}, compute {cc}, {p.total_memory / 2**30:.1f} GiB, fp16 yes, "
            f"bf16 {'yes' if bf16 else 'no'}, tf32 {'yes' if p.major >= 8 else 'no'}",
        )


def _build(r: _Report) -> bool:
    import fastamp

    r.section("fastamp build")
    if fastamp.LOAD_ERROR is not None:
        r.problem(
            f"fastamp's compiled library did not load: {fastamp.LOAD_ERROR}",
            "install a torch the library supports (see the message), or rebuild fastamp: pip "
            "install --no-build-isolation --force-reinstall --no-deps <fastamp source> (or "
            "`make test` in a checkout)",
        )
        return False
    info = fastamp.build_info()
    r.info("fastamp", info["fastamp_version"])
    r.info(
        "built for torch",
        f">= {info['torch_target']} (LibTorch stable ABI; compiled with {info['torch_version']})",
    )
    r.info(
        "CUDA kernels", f"yes, archs {' '.join(info['cuda_archs'])}" if info["with_cuda"] else "no"
    )
    if torch.cuda.is_available() and not info["with_cuda"]:
        r.problem(
            "a GPU is visible but fastamp was built without CUDA kernels",
            "install a CUDA build of torch and nvcc, then rebuild fastamp (FASTAMP_CUDA=ON)",
        )
    if torch.cuda.is_available() and info["with_cuda"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            have = [a.replace("+PTX", "") for a in info["cuda_archs"]]
            cc = f"{p.major}.{p.minor}"
            ptx = any(a.endswith("+PTX") and float(a[:-4]) <= float(cc) for a in info["cuda_archs"])
            if cc not in have and not ptx:
                r.problem(
                    f"cuda:{i} has compute capability {cc}, not among the built archs {have}",
                    f'rebuild with TORCH_CUDA_ARCH_LIST="{cc}" (or add +PTX to an older arch)',
                )
    missing = [op for op, keys in info["ops"].items() if "CPU" not in keys]
    if missing:
        r.problem(
            f"ops without a CPU kernel: {missing}", "rebuild fastamp; the build is incomplete"
        )
    return True


def _selftests(device: str) -> list[tuple[str, Callable[[], None]]]:
    from fastamp.checkpoint import ops as ck
    from fastamp.optim import ops as optim_ops
    from fastamp.parallel import ops as parallel_ops
    from fastamp.scaler import ops
    from fastamp.testing import (
        adam_ref,
        clip_unscale_ref,
        grad_stats_ref,
        make_grads,
        sgd_ref,
        unscale_ref,
        update_scale_ref,
    )

    shapes = [(300,), (70000,), (7, 9)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]

    def close(a: Tensor, b: Tensor, rtol: float) -> None:
        torch.testing.assert_close(a.detach().double().cpu(), b.double(), rtol=rtol, atol=1e-6)

    def grad_stats() -> None:
        g = make_grads(shapes, dtypes, device, seed=1, scale=10.0)
        g[0][3] = math.nan
        found, pow_sum, flags = ops.grad_stats(g, torch.tensor(0.5, device=device))
        ref = grad_stats_ref(g, 0.5)
        assert float(found) == ref[0] and flags.tolist() == ref[2]
        g[0][3] = 1.0
        _, pow_sum, _ = ops.grad_stats(g, torch.tensor(0.5, device=device))
        assert math.isclose(float(pow_sum), grad_stats_ref(g, 0.5)[1], rel_tol=1e-5)

    def unscale() -> None:
        g = make_grads(shapes, dtypes, device, seed=2, scale=100.0)
        exp = unscale_ref(g, 0.25)
        found = torch.zeros((), device=device)
        ops.non_finite_check_and_unscale_(g, found, torch.tensor(0.25, device=device))
        assert float(found) == 0.0
        for a, b in zip(g, exp):
            close(a, b, 1e-2)

    def clip() -> None:
        g = make_grads(shapes, torch.float32, device, seed=3, scale=100.0)
        exp = clip_unscale_ref(g, 0.5, 3.0, 1.0)
        ops.clip_unscale_(
            g, torch.tensor(0.5, device=device), torch.tensor(3.0, device=device), 1.0
        )
        for a, b in zip(g, exp):
            close(a, b, 1e-6)

    def update_scale() -> None:
        s = torch.tensor(1024.0, device=device)
        gt = torch.zeros((), dtype=torch.int32, device=device)
        ht = torch.ones((), dtype=torch.int32, device=device)
        ref = (1024.0, 0, 1)
        for inf in (False, True, False, False):
            ops.update_scale_(s, gt, ht, torch.tensor(float(inf), device=device), 2.0, 0.5, 2)
            ref = update_scale_ref(*ref, inf, 2.0, 0.5, 2)
            assert (float(s), int(gt), int(ht)) == ref

    # The AdamW step both Adam checks run: its hyper-parameters and the float64 reference.
    ADAMW = optim_ops.AdamHyper(
        1e-2, None, 0.9, 0.999, 0.01, 1e-8, decoupled_weight_decay=True, maximize=False
    )

    def adamw_expected(
        p: Tensor, g: Tensor, m: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        kw: dict[str, float] = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        return adam_ref(p, g, m, v, None, 1, **kw, amsgrad=False, decoupled=True, maximize=False)

    def adam() -> None:
        p, g = (
            make_grads([(999,)], torch.float32, device, seed=4),
            make_grads([(999,)], torch.float32, device, seed=5),
        )
        m, v = [torch.zeros_like(p[0])], [torch.zeros_like(p[0])]
        exp = adamw_expected(p[0], g[0], m[0], v[0])
        optim_ops.adam_step_(p, g, m, v, [], [torch.zeros((), device=device)], [], ADAMW)
        close(p[0], exp[0], 1e-5)

    def adam_lowbit() -> None:
        from fastamp.optim import lowbit

        for fmt in ("int8", "bfloat16"):
            p = make_grads([(5000,)], torch.float32, device, seed=9)[0]
            g = make_grads([(5000,)], torch.float32, device, seed=10)[0]
            m = make_grads([(5000,)], torch.float32, device, seed=11)[0] * 1e-2
            v = make_grads([(5000,)], torch.float32, device, seed=12)[0].abs() * 1e-3
            form = lowbit.resolve(fmt, "fastamp doctor")
            st = form.encode({"exp_avg": m, "exp_avg_sq": v}, p)
            floats = form.decode(st, lowbit.ADAM_MOMENTS)
            exp = adamw_expected(p, g, floats["exp_avg"], floats["exp_avg_sq"])
            optim_ops.adam_lowbit_step_(
                [p], [g], *form.adam_lists([st]), [torch.zeros((), device=device)], [], 0, ADAMW
            )
            close(p, exp[0], 1e-5)

    def sgd() -> None:
        p, g = (
            make_grads([(999,)], torch.float32, device, seed=6),
            make_grads([(999,)], torch.float32, device, seed=7),
        )
        b = [torch.zeros_like(p[0])]
        exp = sgd_ref(
            p[0],
            g[0],
            None,
            True,
            lr=0.1,
            momentum=0.9,
            dampening=0.0,
            weight_decay=0.0,
            nesterov=False,
            maximize=False,
        )
        hyper = optim_ops.SgdHyper(
            0.1, None, weight_decay=0.0, momentum=0.9, dampening=0.0, nesterov=False, maximize=False
        )
        optim_ops.sgd_step_(p, g, b, [torch.zeros((), device=device)], [], hyper)
        close(p[0], exp[0], 1e-6)

    def digest_and_rng() -> None:
        x = torch.randn(1001, device=device)
        y = x.clone()
        y.view(torch.int32)[5] ^= 1
        d = ck.tensor_digest([x, x.clone(), y])
        assert d[0] == d[1] and d[0] != d[2]
        st = ck.rng_get_state()
        a = torch.rand(4, device=device)
        ck.rng_set_state(st)
        assert torch.equal(a, torch.rand(4, device=device))

    def buckets() -> None:
        g = make_grads([(10,), (70000,)], torch.float32, device, seed=8)
        bucket = torch.zeros(70010, device=device)
        parallel_ops.bucket_pack_(bucket, g, [0, 10], 0.5)
        out = [torch.empty_like(t) for t in g]
        found, sq = parallel_ops.bucket_unpack_(
            bucket, out, [0, 10], torch.tensor(1.0, device=device)
        )
        for a, b in zip(out, g):
            close(a, b.double().cpu() * 0.5, 1e-7)
        assert float(found) == 0.0 and math.isclose(
            float(sq), sum(float((t.double() * 0.5).square().sum()) for t in g), rel_tol=1e-5
        )

    return [
        ("grad_stats", grad_stats),
        ("non_finite_check_and_unscale_", unscale),
        ("clip_unscale_", clip),
        ("update_scale_", update_scale),
        ("adam_step_", adam),
        ("adam_lowbit_step_", adam_lowbit),
        ("sgd_step_", sgd),
        ("tensor_digest + rng_get/set_state", digest_and_rng),
        ("bucket_pack_/unpack_", buckets),
    ]


def _selftest(r: _Report) -> None:
    devices = (
        ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else ["cpu"]
    )
    import fastamp

    if torch.cuda.is_available() and not fastamp.build_info()["with_cuda"]:
        devices = ["cpu"]
    for device in devices:
        r.section(f"self-test on {device} (against float64 references)")
        for name, fn in _selftests(device):
            try:
                fn()
                r.info(name, "ok")
            except Exception as e:
                r.problem(
                    f"{name} on {device} gave a wrong result or failed: {e!r}",
                    "report it with this output; meanwhile use the torch counterparts on this device",
                )
                if not r.quiet:
                    traceback.print_exc()


def run(quiet: bool = False) -> int:
    r = _Report(quiet)
    if not quiet:
        print("fastamp doctor")
    _versions(r)
    _gpus(r)
    if _build(r):
        _selftest(r)
    if r.problems:
        print(f"\n{len(r.problems)} problem(s) found; fixes above.")
        return 1
    if not quiet:
        print("\nall checks passed")
    return 0
