"""One representative call of every CUDA kernel's op, with the bytes per element its kernels
should move through DRAM: the model that the emulator's traffic counts (csrc/emu/traffic.h) are
checked against (tests/cuda_emu/test_traffic.py) and that `make gpu-traffic` tabulates
(benchmarks/gpu/emulated_traffic.py).

Inputs are contiguous, allocator-aligned lists of three tensors (two chunks and a tail, a
mid-sized tensor, a small one), the shape of a model's parameter list.

The model counts each tensor an op must read or write once, at its element size. Per-tensor
scalars (step counts, found_inf, the 8-bit codes' per-256-element scales) are counted at their
size too; shared scalars (lr, inv_scale, the clip coefficient) are a few sectors per launch,
below the margin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastamp.optim import lowbit

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SIZES = (2 * 65536 + 1000, 4096, 300)
ELEMENTS = sum(SIZES)
BLOCK8 = 256  # elements per scale of the 8-bit codes


#: The fewest sectors per request of the low-precision state kernels' cases: those of the fp32
#: path's (adam_step_ float32: 15.48 on these inputs; test_traffic.py also compares the two).
LOWBIT_SECTORS_PER_REQUEST = 15.4

#: A launch's DRAM bytes may differ from the model by this much (relative, plus absolute bytes
#: per element: the shared scalars), its sectors per ideal sector by COALESCING.
MARGIN_REL, MARGIN_ABS = 0.005, 0.01
COALESCING = 1.01


@dataclass(frozen=True)
class Budget:
    load: float  # model: DRAM bytes read per element
    store: float  # model: DRAM bytes written per element
    reread: float = 0.1  # sectors moved beyond the distinct ones, bytes per element
    #: the fewest sectors per request (loads and stores of all the op's launches): a kernel that
    #: moves 16-byte vectors per lane issues about 16, one element per lane 1-4
    sectors_per_request: float = 0.0


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    args: Callable[[], tuple]
    budget: Budget
    reads: tuple[int, ...]  # arguments (tensors or lists) every byte of which must be read
    writes: tuple[int, ...]  # arguments the op may change

    @property
    def load(self) -> float:
        return self.budget.load

    @property
    def store(self) -> float:
        return self.budget.store


def problems(launches, budget: Budget, elements: int) -> list[str]:
    """What the traced `launches` (one op's) break of `budget`: DRAM bytes per element off the
    model, a request that touches more sectors than its bytes need, sectors re-read."""
    launches = [launches] if not isinstance(launches, list) else launches
    out = []
    for ln in launches:
        for what, a in (("load", ln.load), ("store", ln.store)):
            if a.ideal_sectors and a.coalescing > COALESCING:
                out.append(f"{ln.kernel}: {what} coalescing {a.coalescing:.2f} sectors per ideal "
                           f"sector (> {COALESCING})")  # fmt: skip
    for what, model in (("load", budget.load), ("store", budget.store)):
        got = sum(32 * getattr(ln, what).unique_sectors for ln in launches) / elements
        if abs(got - model) > MARGIN_REL * model + MARGIN_ABS:
            out.append(f"{what}: {got:.4f} DRAM bytes per element; the model says {model:.4f}")
    again = sum(32 * (a.sectors - a.unique_sectors) for ln in launches
                for a in (ln.load, ln.store)) / elements  # fmt: skip
    if again > budget.reread:
        out.append(f"{again:.3f} bytes per element re-read (allowed {budget.reread})")
    spr = sectors_per_request(launches)
    if spr < budget.sectors_per_request:
        out.append(f"{spr:.2f} sectors per request (at least {budget.sectors_per_request} wanted: "
                   "16-byte vectors per lane)")  # fmt: skip
    return out


def sectors_per_request(launches) -> float:
    """Sectors per warp request over the loads and stores of `launches`."""
    launches = [launches] if not isinstance(launches, list) else launches
    req = sum(a.requests for ln in launches for a in (ln.load, ln.store))
    return sum(a.sectors for ln in launches for a in (ln.load, ln.store)) / max(req, 1)


def sectors_of(t: torch.Tensor) -> set[int]:
    """The 32-byte sectors a contiguous tensor's bytes occupy."""
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    return set(range(lo // 32, (hi - 1) // 32 + 1)) if hi > lo else set()


def changed_sectors(old: torch.Tensor, new: torch.Tensor) -> set[int]:
    """The sectors of `new` whose bytes differ from `old` (its copy from before the op)."""
    a = old.reshape(-1).view(torch.uint8)
    b = new.reshape(-1).view(torch.uint8)
    idx = (a != b).nonzero().flatten().tolist()
    return {(new.data_ptr() + i) // 32 for i in idx}


def _rand(n: int, dtype: torch.dtype, scale: float = 1.0, gen: torch.Generator | None = None):
    x = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)  # never zeros
    return x.to(dtype)


def _lists(dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [_rand(n, dtype, scale, gen) for n in SIZES]


def _steps() -> list[torch.Tensor]:
    return [torch.tensor(3.0) for _ in SIZES]


def _scaling():
    return torch.tensor(1 / 256), torch.tensor(0.0), torch.tensor(0.5)


def _adam(dtype: torch.dtype, master: bool = False, amsgrad: bool = False):
    sdt = F32 if master else dtype

    def args():
        ps, gs = _lists(dtype, 1.0, 1), _lists(dtype, 256.0, 2)
        ms, vs = _lists(sdt, 0.1, 3), [v.abs() for v in _lists(sdt, 0.1, 4)]
        vmax = [v.abs() * 2 for v in _lists(sdt, 0.1, 5)] if amsgrad else []
        masters = [p.float() for p in ps] if master else []
        return (ps, gs, ms, vs, vmax, _steps(), masters, 1e-2, None, 0.9, 0.999, 0.05, 1e-8,
                amsgrad, True, False, *_scaling())  # fmt: skip

    return args


def _adam_lowbit(fmt: str):
    def args():
        codec = lowbit.resolve(fmt, "traffic")
        ms, vs, ams, avs = [], [], [], []
        for n in SIZES:
            m, v = _rand(n, F32, 1e-2), _rand(n, F32, 1e-3).abs()
            st = codec.encode({"exp_avg": m, "exp_avg_sq": v}, torch.empty(n))
            m8, v8, am, av = codec.adam_lists([st])
            ms += m8
            vs += v8
            ams += am
            avs += av
        return (_lists(F32, 1.0, 1), _lists(F32, 64.0, 2), ms, vs, ams, avs, _steps(), [], 12345,
                0.05, None, 0.9, 0.999, 0.01, 1e-8, True, False, *_scaling())  # fmt: skip

    return args


def _sgd(dtype: torch.dtype, lowbit_state: bool):
    def args():
        ps, gs = _lists(dtype, 1.0, 1), _lists(dtype, 256.0, 2)
        bufs = _lists(BF16 if lowbit_state else dtype, 0.1, 3)
        head = (ps, gs, bufs, _steps(), [])
        tail = (None, 1e-4, 0.9, 0.0, False, False, *_scaling())
        return (*head, 12345, 1e-2, *tail) if lowbit_state else (*head, 1e-2, *tail)

    return args


def _bucket(dtype: torch.dtype, unpack: bool):
    def args():
        gs = _lists(dtype, 10.0, 1)
        offsets = [0, SIZES[0], SIZES[0] + SIZES[1]]
        bucket = _rand(ELEMENTS, dtype, 3.0)
        return (bucket, gs, offsets, torch.tensor(0.25) if unpack else 0.25)

    return args


def _divide_stats(dtype: torch.dtype):
    def args():
        return (_rand(ELEMENTS, dtype, 300.0), list(SIZES), 2.0, torch.tensor(0.25))

    return args


def _sized(dtype: torch.dtype) -> float:
    return torch.empty(0, dtype=dtype).element_size()


def cases() -> list[Case]:
    out: list[Case] = []
    for dt in (F32, F16, BF16):
        s, name = _sized(dt), str(dt).removeprefix("torch.")
        out += [
            Case(f"grad_stats {name}", "grad_stats",
                 lambda dt=dt: (_lists(dt, 100.0), torch.tensor(0.5), 2.0), Budget(s, 0),
                 reads=(0,), writes=()),
            Case(f"non_finite_check_and_unscale_ {name}", "non_finite_check_and_unscale_",
                 lambda dt=dt: (_lists(dt, 100.0), torch.tensor(0.0), torch.tensor(0.5),
                                torch.zeros(len(SIZES), dtype=torch.bool)), Budget(s, s),
                 reads=(0,), writes=(0, 1, 3)),
            Case(f"clip_unscale_ {name}", "clip_unscale_",
                 lambda dt=dt: (_lists(dt, 100.0), torch.tensor(0.5), torch.tensor(1e4), 1.0),
                 Budget(s, s), reads=(0,), writes=(0,)),
            Case(f"bucket_pack_ {name}", "bucket_pack_", _bucket(dt, False), Budget(s, s),
                 reads=(1,), writes=(0,)),
            Case(f"bucket_unpack_ {name}", "bucket_unpack_", _bucket(dt, True), Budget(s, s),
                 reads=(0,), writes=(1,)),
            # DDP's comm-hook pass: the bucket read once and divided in place (written once).
            Case(f"bucket_divide_stats_ {name}", "bucket_divide_stats_", _divide_stats(dt),
                 Budget(s, s), reads=(0,), writes=(0,)),
            Case(f"tensor_digest {name}", "tensor_digest", lambda dt=dt: (_lists(dt),),
                 Budget(s, 0), reads=(0,), writes=()),
        ]  # fmt: skip
    # Adam: reads param, grad, exp_avg, exp_avg_sq (+ max_exp_avg_sq, + master); writes param,
    # the moments (+ the max, + master) and the step counts.
    adam_r, adam_w = (0, 1, 2, 3, 4, 6), (0, 2, 3, 4, 5, 6)
    lowbit_r, lowbit_w = (0, 1, 2, 3, 4, 5), (0, 2, 3, 4, 5, 6)
    # The low-precision state kernels move 16-byte vectors per lane, as the fp32 and half ones
    # (their 1- and 2-byte lists through a warp transpose in shared memory, the 8-bit scales
    # through shared memory once per chunk): their requests must carry at least the sectors of
    # adam_step_ float32's (15.48), which a kernel moving one element per lane (2-3) or 8 bytes
    # per lane (8-12) does not.
    vec = LOWBIT_SECTORS_PER_REQUEST
    out += [
        Case("adam_step_ float32", "adam_step_", _adam(F32), Budget(16, 12), adam_r, adam_w),
        Case("adam_step_ float32 amsgrad", "adam_step_", _adam(F32, amsgrad=True),
             Budget(20, 16), adam_r, adam_w),
        Case("adam_step_ bfloat16", "adam_step_", _adam(BF16), Budget(8, 6), adam_r, adam_w),
        # bf16 params and grads, fp32 master and moments: the param is written, never read.
        Case("adam_step_ bfloat16 master", "adam_step_", _adam(BF16, master=True),
             Budget(14, 14), (1, 2, 3, 6), adam_w),
        Case("adam_lowbit_step_ bfloat16 state", "adam_lowbit_step_", _adam_lowbit("bfloat16"),
             Budget(12, 8, sectors_per_request=vec), lowbit_r, lowbit_w),
        Case("adam_lowbit_step_ int8 state", "adam_lowbit_step_", _adam_lowbit("int8"),
             Budget(10 + 8 / BLOCK8, 6 + 8 / BLOCK8, sectors_per_request=vec), lowbit_r,
             lowbit_w),
        # SGD with momentum: reads param, grad, buffer; writes param, buffer, step counts.
        Case("sgd_step_ float32", "sgd_step_", _sgd(F32, False), Budget(12, 8), (0, 1, 2),
             (0, 2, 3)),
        Case("sgd_lowbit_step_ bfloat16 momentum", "sgd_lowbit_step_", _sgd(F32, True),
             Budget(10, 6, sectors_per_request=vec), (0, 1, 2), (0, 2, 3)),
    ]  # fmt: skip
    return out


def by_name() -> dict[str, Case]:
    return {c.name: c for c in cases()}


#: The whole optimizer step of a mixed-precision recipe, fp32 params and grads: fastamp's stats
#: pass (found_inf + norm in one read) and its fused update, per state format.
STEP_FORMATS = {
    "fp32 state": ["grad_stats float32", "adam_step_ float32"],
    "bf16 state": ["grad_stats float32", "adam_lowbit_step_ bfloat16 state"],
    "8-bit state": ["grad_stats float32", "adam_lowbit_step_ int8 state"],
}

#: torch's recipe for the same step (GradScaler.unscale_ + clip_grad_norm_ + AdamW(fused=True)),
#: counted from its kernels, fp32: _amp_foreach_non_finite_check_and_unscale_ reads and writes
#: the grads (8 B), clip_grad_norm_'s norm reads them (4 B) and its multiply reads and writes
#: them (8 B), _fused_adamw_ reads p, g, m, v and writes p, m, v (28 B).
TORCH_RECIPE_BYTES = {"unscale + inf check": 8, "norm": 4, "clip multiply": 8, "fused AdamW": 28}
