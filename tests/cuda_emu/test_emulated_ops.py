"""Every CUDA op of fastamp (host launcher + kernels), run by the CUDA emulator, against the CPU
kernel on the same inputs (see harness.py for what is compared).

The inputs cover what the CUDA side handles differently from the CPU side: sizes around the
16-byte vector width and the 64 Ki-element chunk, starting addresses misaligned by 1-5 elements
(no vector loads for those), strided tensors that the launcher stages and writes back, empty
tensors, more tensors than one launch's argument table holds, a tensor split across two launches,
more than 512 per-chunk partial sums, inf/-inf/NaN, and the device-side scalars (found_inf set:
nothing written; clip coefficients; tensor learning rates).
"""

from __future__ import annotations

import math

import emu
import pytest
import torch
from harness import Mem, bits, held_variant, run_case

from fastamp.testing import op_args

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
CHUNK = 65536
# Sizes: below / not a multiple of the vector width (4 fp32, 8 half, 2 fp64), and around a chunk.
EDGE_SIZES = [1, 3, 7, 13, 100, CHUNK - 1, CHUNK, CHUNK + 3]


def grads(mem: Mem, spec, scale: float = 1.0, inject=None):
    """spec: list of (numel, dtype, offset, stride). inject: {tensor index: [(element, value)]}."""
    out = []
    for i, (n, dt, off, stride) in enumerate(spec):
        vals = mem.randn(n, dt, scale)
        for j, v in (inject or {}).get(i, []):
            vals[j] = v
        out.append(mem.place(vals, off, stride))
    return out


def spec_of(sizes, dtypes, offsets=(0,), strides=(1,)):
    return [
        (n, dtypes[i % len(dtypes)], offsets[i % len(offsets)], strides[i % len(strides)])
        for i, n in enumerate(sizes)
    ]


LIST_CASES = {
    # name: (spec, inject)
    "fp32-edges": (spec_of(EDGE_SIZES, [F32]), None),
    # One tensor in one chunk: the launchers' single-chunk case (one block, one partial).
    "one-chunk": (spec_of([1000], [F32]), None),
    "fp16-edges-misaligned": (spec_of(EDGE_SIZES, [F16], offsets=[1, 2, 3, 4, 5]), None),
    "bf16-edges-misaligned": (spec_of(EDGE_SIZES, [BF16], offsets=[5, 0, 3]), None),
    "fp64-edges": (spec_of(EDGE_SIZES, [F64], offsets=[0, 1]), None),
    "mixed-with-empty": (
        spec_of([300, 0, 7, 4099, 0, 1, 65537], [F32, F16, BF16, F64], offsets=[0, 3, 1, 2]),
        None,
    ),
    "strided-staged": (
        spec_of([100, 7, 5000, 33], [F32, F16, BF16, F64], offsets=[0, 1], strides=[2, 3, 1]),
        None,
    ),
    "inf": (spec_of([1000, 70000, 13], [F32, F16, BF16]), {1: [(66000, math.inf)]}),
    "neg-inf-nan": (
        spec_of([1000, 70000, 13, 9], [F32, F16, BF16, F64]),
        {0: [(3, -math.inf)], 3: [(8, math.nan)]},
    ),
}


def _stats_ref(gs, inv, p):
    total = 0.0
    for g in gs:
        u = g.double() * inv
        if not torch.isfinite(u).all():
            return math.nan
        if math.isinf(p):
            total = max(total, float(u.abs().max()) if u.numel() else 0.0)
        else:
            total += float(u.abs().pow(p).sum())
    return total


@pytest.mark.parametrize("case", sorted(LIST_CASES))
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_grad_stats(case, norm_type):
    spec, inject = LIST_CASES[case]
    inv = 1.0 / 64.0

    def build(mem):
        return grads(mem, spec, 64.0, inject), torch.tensor(inv), norm_type

    # The inf-norm is a max: exact, so it must match the CPU bit for bit like everything else.
    red = () if math.isinf(norm_type) else (1,)
    run_case(
        "grad_stats",
        build,
        reductions=red,
        reduction_ref=lambda a: [_stats_ref(a[0], inv, norm_type)],
        rtol=2e-5 if norm_type != 3.0 else 1e-4,
    )


@pytest.mark.parametrize("case", sorted(LIST_CASES))
def test_non_finite_check_and_unscale(case):
    spec, inject = LIST_CASES[case]

    def build(mem):
        gs = grads(mem, spec, 1024.0, inject)
        return (
            gs,
            torch.zeros(()),
            torch.tensor(1.0 / 1024.0),
            torch.zeros(len(gs), dtype=torch.bool),
        )

    run_case("non_finite_check_and_unscale_", build)


@pytest.mark.parametrize("case", sorted(LIST_CASES))
@pytest.mark.parametrize(
    "total_norm,max_norm", [(10.0, 1.0), (0.5, 1.0), (math.inf, 1.0), (3.0, 3.0)]
)
def test_clip_unscale(case, total_norm, max_norm):
    spec, inject = LIST_CASES[case]

    def build(mem):
        return (
            grads(mem, spec, 8.0, inject),
            torch.tensor(0.125),
            torch.tensor(total_norm),
            max_norm,
        )

    run_case("clip_unscale_", build)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize(
    "pow_sum,max_norm",
    [(1.0118544101715088, 1.0), (6822148.0, 5.3), (0.0, 0.0), (math.inf, 1.0), (math.nan, 0.7),
     (1e-30, math.inf), (3.4e38, 1e9)],
)  # fmt: skip
def test_clip_coef(norm_type, pow_sum, max_norm):
    def build(mem):
        return mem.place(torch.tensor([pow_sum]), 1).view(()), norm_type, max_norm

    run_case("clip_coef", build)


@pytest.mark.parametrize("n", [0, 1, 5, 257, 1000])
@pytest.mark.parametrize("found", [0.0, 1.0, 2.0, math.nan])
def test_record_overflow(n, found):
    def build(mem):
        flags = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
        return (
            mem.place(torch.zeros(n, dtype=torch.bool), 1),
            mem.place(torch.tensor([-1], dtype=torch.int64), 2).view(()),
            flags,
            torch.tensor(found),
            torch.tensor(n + 3, dtype=torch.int64),
        )

    run_case("record_overflow_", build)


# --- launch-table edges -------------------------------------------------------------------------


def test_more_tensors_than_one_launch_holds_and_many_partials():
    # 600 one-chunk tensors: 6 launches for a one-list op (105 tensors each), 600 partial sums
    # (more than the 512 threads of the combining kernel).
    spec = spec_of(
        [5 + (i * 37) % 300 for i in range(600)], [F32, F16, BF16, F64], offsets=[0, 1, 2]
    )
    inject_none = None

    def build_stats(mem):
        return grads(mem, spec, 2.0, inject_none), torch.tensor(0.5), 2.0

    run_case(
        "grad_stats",
        build_stats,
        reductions=(1,),
        reduction_ref=lambda a: [_stats_ref(a[0], 0.5, 2.0)],
        orders=("ascending", "random"),
    )

    def build_unscale(mem):
        gs = grads(mem, spec, 2.0, {599: [(0, math.nan)]})
        return gs, torch.zeros(()), torch.tensor(0.5), torch.zeros(len(gs), dtype=torch.bool)

    run_case("non_finite_check_and_unscale_", build_unscale, orders=("descending",))


def test_tensor_split_across_two_launches():
    # 320 blocks per launch: 3 small tensors then one of 330 chunks, which the first launch cuts.
    spec = spec_of([10, 20, 30, 330 * CHUNK - 17], [F32], offsets=[0, 1, 2, 3])

    def build_stats(mem):
        return grads(mem, spec, 1.0, {3: [(318 * CHUNK, -math.inf)]}), torch.tensor(1.0), 2.0

    run_case("grad_stats", build_stats, reductions=(1,), orders=("ascending", "random"))

    def build_clip(mem):
        return grads(mem, spec, 1.0), torch.tensor(0.5), torch.tensor(7.0), 2.0

    run_case("clip_unscale_", build_clip, orders=("descending",))


# --- update_scale_ ----------------------------------------------------------------------------

INT32_MAX = 2**31 - 1
SCALE_STATES = [
    # scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff, interval,
    # hysteresis, min_scale, max_scale
    (65536.0, 0, 1, 0.0, 2.0, 0.5, 2000, 1, 0.0, math.inf),
    (65536.0, 1999, 1, 0.0, 2.0, 0.5, 2000, 1, 0.0, math.inf),
    (65536.0, 5, 1, 1.0, 2.0, 0.5, 2000, 1, 0.0, math.inf),
    (2.0**127, 9, 1, 0.0, 2.0, 0.5, 10, 1, 0.0, math.inf),  # growth to inf is refused
    (
        1.0,
        INT32_MAX - 1,
        1,
        0.0,
        2.0,
        0.5,
        INT32_MAX,
        1,
        0.0,
        math.inf,
    ),  # tracker reaches INT32_MAX
    (1.0, INT32_MAX - 2, 1, 0.0, 2.0, 0.5, INT32_MAX, 1, 0.0, math.inf),
    (8.0, 3, 3, 1.0, 2.0, 0.5, 100, 3, 0.0, math.inf),  # hysteresis absorbs an overflow
    (8.0, 3, 1, 1.0, 2.0, 0.5, 100, 3, 4.0, 16.0),  # backoff clamped at min_scale
    (16.0, 99, 1, 0.0, 2.0, 0.5, 100, 1, 1.0, 16.0),  # growth clamped at max_scale
    (3.0, 0, 1, math.nan, 1.5, 0.25, 1, 2, 0.0, math.inf),
]


@pytest.mark.parametrize("state", SCALE_STATES, ids=range(len(SCALE_STATES)))
def test_update_scale(state):
    scale, gt, ht, found, gf, bf, interval, hyst, lo, hi = state

    def build(mem):
        return (
            mem.place(torch.tensor([scale]), 1).view(()),
            mem.place(torch.tensor([gt], dtype=torch.int32), 2).view(()),
            mem.place(torch.tensor([ht], dtype=torch.int32)).view(()),
            torch.tensor(found),
            gf,
            bf,
            interval,
            hyst,
            lo,
            hi,
        )

    run_case("update_scale_", build)


# --- optimizers -------------------------------------------------------------------------------

OPT_SPECS = {
    "fp32": spec_of([1, 3, 7, 13, 1000, CHUNK + 5], [F32], offsets=[0, 1, 2, 3, 4, 5]),
    "fp16": spec_of([1, 9, 4097, CHUNK - 1], [F16], offsets=[0, 3, 1]),
    "bf16": spec_of([2, 31, 5000], [BF16], offsets=[1, 0]),
}


def _adam_build(
    spec, *, amsgrad, master, decoupled, maximize, lr_tensor, found, clip, inject=None, shift=None,
    beta1=0.9,
):  # fmt: skip
    """`shift` ({list name: elements}) moves one list off the others' alignment."""
    sh = shift or {}

    def build(mem):
        params = [
            mem.place(mem.randn(n, dt), off + sh.get("params", 0), st) for (n, dt, off, st) in spec
        ]
        gs = grads(mem, spec, 256.0, inject)
        sdt = [F32 if master else dt for (_, dt, _, _) in spec]
        ms = [
            mem.place(mem.randn(n, s, 0.1), off + sh.get("exp_avgs", 0))
            for (n, _, off, _), s in zip(spec, sdt)
        ]
        vs = [mem.place(mem.randn(n, s, 0.1).abs(), off) for (n, _, off, _), s in zip(spec, sdt)]
        vmax = (
            [
                mem.place(mem.randn(n, s, 0.2).abs(), off + sh.get("max_exp_avg_sqs", 0))
                for (n, _, off, _), s in zip(spec, sdt)
            ]
            if amsgrad
            else []
        )
        masters = (
            [
                mem.place(p.float() + 1e-3, off + sh.get("master_params", 0))
                for p, (_, _, off, _) in zip(params, spec)
            ]
            if master
            else []
        )
        steps = [mem.place(torch.tensor([float(i % 4)]), i % 3).view(()) for i in range(len(spec))]
        lr_t = torch.tensor(3e-3) if lr_tensor else None
        return op_args("adam_step_", params=params, grads=gs, exp_avgs=ms, exp_avg_sqs=vs,
                       max_exp_avg_sqs=vmax, state_steps=steps, master_params=masters, lr=1e-2,
                       lr_tensor=lr_t, beta1=beta1, weight_decay=0.05, amsgrad=amsgrad,
                       decoupled_weight_decay=decoupled, maximize=maximize,
                       inv_scale=torch.tensor(1 / 256), found_inf=torch.tensor(found),
                       clip_coef=torch.tensor(clip))  # fmt: skip

    return build


ADAM_VARIANTS = [
    dict(amsgrad=False, master=False, decoupled=True, maximize=False, lr_tensor=False),
    dict(amsgrad=True, master=False, decoupled=False, maximize=True, lr_tensor=False),
    dict(amsgrad=False, master=True, decoupled=True, maximize=False, lr_tensor=True),
    dict(amsgrad=True, master=True, decoupled=False, maximize=False, lr_tensor=False),
]


def _dtype_variants(variants):
    """(dtype, variant index) of each OPT_SPECS dtype and variant, but master weights with fp32
    params: they are for fp16/bf16 params (the op's checks refuse them for fp32)."""
    return [
        (d, v)
        for d in sorted(OPT_SPECS)
        for v in range(len(variants))
        if not (variants[v]["master"] and d == "fp32")
    ]


@pytest.mark.parametrize("dtype,variant", _dtype_variants(ADAM_VARIANTS))
def test_adam_step(dtype, variant):
    v = ADAM_VARIANTS[variant]
    run_case("adam_step_", _adam_build(OPT_SPECS[dtype], found=0.0, clip=0.7, **v))


@pytest.mark.parametrize("moved", ["params", "exp_avgs", "max_exp_avg_sqs", "master_params"])
def test_adam_step_lists_aligned_differently(moved):
    """One list one element off the others' 16-byte alignment: the kernel must take the scalar
    path for every list (a vector access through the moved list faults on a GPU and here)."""
    spec = spec_of([4096, 1000], [F16], offsets=[1])  # every list 16-byte aligned but the moved one
    build = _adam_build(
        spec, amsgrad=True, master=True, decoupled=True, maximize=False, lr_tensor=False,
        found=0.0, clip=0.5, shift={moved: 1},
    )  # fmt: skip
    run_case("adam_step_", build, orders=("ascending",))


def test_adam_step_beta1_below_half():
    """beta1 < 0.5: the moment's lerp weight 1 - beta1 is above 0.5, torch.lerp's other branch."""
    build = _adam_build(
        OPT_SPECS["fp32"], amsgrad=False, master=False, decoupled=True, maximize=False,
        lr_tensor=False, found=0.0, clip=0.5, beta1=0.3,
    )  # fmt: skip
    run_case("adam_step_", build, orders=("ascending",))


@pytest.mark.parametrize("variant", range(len(ADAM_VARIANTS)))
def test_adam_step_found_inf_writes_nothing(variant):
    v = ADAM_VARIANTS[variant]
    spec = OPT_SPECS["bf16"] if v["master"] else OPT_SPECS["fp32"]
    build = _adam_build(spec, found=1.0, clip=0.5, inject={0: [(0, math.inf)]}, **v)
    out = run_case("adam_step_", build, orders=("ascending", "random"))
    fresh = [t.clone() for t in _flat(build(Mem(0)))]
    for i, (a, b) in enumerate(zip(out["emu"], fresh)):
        assert torch.equal(
            a.view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        ), f"adam_step_ with found_inf=1 wrote into argument tensor {i}"


def _flat(args):
    from harness import tensors_of

    return tensors_of(list(args))


def test_adam_step_mixed_dtypes_many_params():
    # 130 params (more than a 4-list launch's table), fp32/fp16/bf16 mixed in one group.
    spec = spec_of(
        [3 + (i * 53) % 700 for i in range(130)], [F32, F16, BF16], offsets=[0, 1, 2, 3, 4, 5]
    )
    build = _adam_build(
        spec,
        amsgrad=False,
        master=False,
        decoupled=True,
        maximize=False,
        lr_tensor=False,
        found=0.0,
        clip=1.0,
    )
    run_case("adam_step_", build, orders=("ascending", "random"))


SGD_VARIANTS = [
    dict(momentum=0.0, dampening=0.0, nesterov=False, master=False, first=True),
    dict(momentum=0.9, dampening=0.1, nesterov=False, master=False, first=False),
    dict(momentum=0.9, dampening=0.0, nesterov=True, master=False, first=True),
    dict(momentum=0.9, dampening=0.0, nesterov=True, master=True, first=False),
    dict(momentum=0.5, dampening=0.3, nesterov=False, master=True, first=True),
]


def _sgd_build(
    spec,
    *,
    momentum,
    dampening,
    nesterov,
    master,
    first,
    found=0.0,
    lr_tensor=False,
    maximize=False,
):
    def build(mem):
        params = grads(mem, spec, 1.0)
        gs = grads(mem, spec, 64.0)
        sdt = [F32 if master else dt for (_, dt, _, _) in spec]
        bufs = (
            [mem.place(mem.randn(n, s), off) for (n, _, off, _), s in zip(spec, sdt)]
            if momentum
            else []
        )
        masters = (
            [mem.place(p.float(), off) for p, (_, _, off, _) in zip(params, spec)] if master else []
        )
        counts = [torch.tensor(0.0 if first else 4.0) for _ in spec]
        return op_args("sgd_step_", params=params, grads=gs, momentum_buffers=bufs,
                       state_steps=counts, master_params=masters, lr=0.05,
                       lr_tensor=torch.tensor(0.02) if lr_tensor else None, weight_decay=0.01,
                       momentum=momentum, dampening=dampening, nesterov=nesterov, maximize=maximize,
                       inv_scale=torch.tensor(1 / 64), found_inf=torch.tensor(found),
                       clip_coef=torch.tensor(0.5))  # fmt: skip

    return build


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["plain", "momentum"])
def test_sgd_step_maximize(momentum):
    build = _sgd_build(
        OPT_SPECS["fp16"],
        momentum=momentum,
        dampening=0.0,
        nesterov=False,
        master=True,
        first=False,
        maximize=True,
    )
    run_case("sgd_step_", build, orders=("ascending", "random"))


@pytest.mark.parametrize("dtype,variant", _dtype_variants(SGD_VARIANTS))
def test_sgd_step(dtype, variant):
    v = SGD_VARIANTS[variant]
    run_case("sgd_step_", _sgd_build(OPT_SPECS[dtype], lr_tensor=variant == 1, **v))


def test_sgd_step_found_inf_writes_nothing():
    build = _sgd_build(
        OPT_SPECS["fp16"],
        momentum=0.9,
        dampening=0.0,
        nesterov=False,
        master=True,
        first=False,
        found=1.0,
    )
    out = run_case("sgd_step_", build, orders=("descending",))
    fresh = _flat(build(Mem(0)))
    for i, (a, b) in enumerate(zip(out["emu"], fresh)):
        assert torch.equal(
            a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        ), i


# --- gradient buckets -------------------------------------------------------------------------


def _bucket_build(dtype, sizes, gap, scale_or_inv, unpack, inject=None, offsets=(0, 1, 2, 3, 4, 5)):
    def build(mem):
        spec = spec_of(sizes, [dtype], offsets=offsets)
        gs = grads(mem, spec, 10.0, inject)
        offs, n = [], 0
        for g in gs:
            offs.append(n)
            n += g.numel() + gap
        bucket = mem.tensor(n, dtype, 3.0, offset=1)
        if unpack:
            return bucket, gs, offs, torch.tensor(scale_or_inv)
        return bucket, gs, offs, scale_or_inv

    return build


BUCKET_SIZES = [1, 7, 300, CHUNK + 1, 0, 13]


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("gap", [0, 3])
def test_bucket_pack(dtype, gap):
    run_case("bucket_pack_", _bucket_build(dtype, BUCKET_SIZES, gap, 0.25, unpack=False))


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("inject", [None, {2: [(5, math.nan)]}, {3: [(CHUNK, -math.inf)]}])
def test_bucket_unpack(dtype, inject):
    build = _bucket_build(dtype, BUCKET_SIZES, 2, 0.125, unpack=True)

    def build_injected(mem):
        bucket, gs, offs, inv = build(mem)
        for i, pos in (inject or {}).items():
            for j, v in pos:
                bucket[offs[i] + j] = v
        return bucket, gs, offs, inv

    def ref(args):
        bucket, gs, offs, inv = args
        total = 0.0
        for g, o in zip(gs, offs):
            u = bucket[o : o + g.numel()].double() * float(inv)
            if not torch.isfinite(u).all():
                return [math.nan]
            total += float(u.square().sum())
        return [total]

    run_case("bucket_unpack_", build_injected, reductions=(1,), reduction_ref=ref, rtol=2e-5)


def test_bucket_unpack_many_chunks():
    # 600 chunks: more partials than the 256 threads of the combining kernel.
    build = _bucket_build(F32, [CHUNK] * 5 + [7] * 595, 0, 0.5, unpack=True, offsets=(0,))
    run_case("bucket_unpack_", build, reductions=(1,), orders=("ascending", "random"))


def _divide_build(dtype, sizes, divisor, inv, inject=None):
    def build(mem):
        n = sum(sizes)
        bucket = mem.tensor(n, dtype, 3.0, offset=1)
        bucket.copy_(mem.randn(n, F32).mul_(10.0).to(dtype))
        for j, v in inject or ():
            bucket[j] = v
        return bucket, list(sizes), divisor, torch.tensor(inv)

    return build


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("inject", [None, [(5, math.nan)], [(CHUNK + 2, -math.inf)]])
def test_bucket_divide_stats(dtype, divisor, inject):
    """DDP's comm-hook pass: the bucket divided in place bit for bit as the CPU kernel does, the
    statistics against float64 and finite exactly where the CPU kernel's are."""
    build = _divide_build(dtype, BUCKET_SIZES, divisor, 0.125, inject)

    def ref(args):
        bucket, lengths, d, inv = args
        u = (
            (bucket.double() * float(inv))
            if d == 1.0
            else bucket.mul(1.0 / d).double() * float(inv)
        )
        return [float(u.square().sum())] if torch.isfinite(u).all() else [math.nan]

    run_case("bucket_divide_stats_", build, reductions=(1,), reduction_ref=ref, rtol=2e-5)


@pytest.mark.parametrize("backend", ["cpu", "emulated-cuda"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_bucket_divide_stats_is_grad_stats_bit_for_bit(backend, dtype):
    # What the DDP hook hands the scaler is grad_stats over the divided spans, bit for bit.
    ns = torch.ops.fastamp if backend == "cpu" else None
    sizes = [5, CHUNK * 2 + 9, 0, 300, 17]
    bucket, lengths, divisor, inv = _divide_build(dtype, sizes, 2.0, 0.25)(Mem(3))
    op = ns.bucket_divide_stats_ if ns else emu.op("bucket_divide_stats_")
    stats = ns.grad_stats if ns else emu.op("grad_stats")
    found, pow_sum = op(bucket, lengths, divisor, inv)
    s_found, s_pow, _ = stats(list(bucket.split(lengths)), inv, 2.0)
    assert float(found) == float(s_found) == 0.0
    assert bits(pow_sum).item() == bits(s_pow).item(), (float(pow_sum), float(s_pow))


# --- tensor digest ----------------------------------------------------------------------------


# Every dtype the CPU tests digest: the kernel reads bytes, whatever they encode.
DIGEST_DTYPES = [F32, F16, BF16, F64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                 torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]  # fmt: skip


@pytest.mark.parametrize("dtype", DIGEST_DTYPES, ids=str)
def test_tensor_digest(dtype):
    sizes = [1, 3, 7, 8, 9, 1000, 300000]

    def build(mem):
        out = []
        for i, n in enumerate(sizes):
            vals = (mem.randn(n, F64, 100.0)).to(dtype)
            out.append(mem.place(vals, offset=i % 6))
        out.append(mem.place(torch.zeros(0, dtype=dtype)))
        return (out,)

    run_case("tensor_digest", build)


@pytest.mark.parametrize("count", [257, 300])
def test_tensor_digest_more_tensors_than_a_block(count):
    """More tensors than a block's 256 threads: the per-tensor finish runs in two blocks (257:
    one tensor past the first block, which a grid rounded down would leave unfinished)."""
    sizes = [(i * 37) % 90 + 1 for i in range(count)]

    def build(mem):
        return ([mem.place(mem.randn(n, F32), offset=i % 4) for i, n in enumerate(sizes)],)

    run_case("tensor_digest", build, orders=("ascending",))


@pytest.mark.parametrize("backend", ["cpu", "emulated-cuda"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_bucket_unpack_norm_is_grad_stats_bit_for_bit(backend, dtype):
    # What DDP hands the scaler must be grad_stats' result over the same grads, not an
    # approximation of it: same chunks, same per-thread order, same reduction, same combine.
    ns = torch.ops.fastamp if backend == "cpu" else None
    build = _bucket_build(
        dtype, [5, CHUNK * 2 + 9, 0, 300, 17], 1, 0.25, unpack=True, offsets=(0, 1, 2)
    )
    bucket, gs, offs, inv = build(Mem(3))
    unpack = ns.bucket_unpack_ if ns else emu.op("bucket_unpack_")
    stats = ns.grad_stats if ns else emu.op("grad_stats")
    found, pow_sum = unpack(bucket, gs, offs, inv)
    s_found, s_pow, _ = stats(gs, inv, 2.0)
    assert float(found) == float(s_found) == 0.0
    assert bits(pow_sum).item() == bits(s_pow).item(), (float(pow_sum), float(s_pow))


# --- memory traffic of the vector paths --------------------------------------------------------


def _traffic(op_name, build):
    args = build(Mem(0))
    emu.reset_stats()
    emu.op(op_name)(*args)
    return emu.vector_traffic()


# Mem.place puts 7 canary elements before each tensor: element offset 1 starts an fp32 tensor
# on a 16-byte boundary of its (allocator-aligned) buffer, offset 2 does not.
@pytest.mark.parametrize("offset", [1, 2], ids=["aligned", "misaligned"])
def test_bulk_bytes_move_as_16_byte_vectors_exactly_when_aligned(offset):
    """On aligned contiguous fp32 lists every element moves in a 16-byte vector access, and the
    bytes are the model's: the stats pass reads 4 B per element, the Adam update reads g, p, m, v
    and writes p, m, v (28 B). One element off alignment, none may (the scalar path)."""
    n = 4 * 5000
    spec = spec_of([n, 4 * 300], [F32], offsets=[offset])
    total = n + 4 * 300

    stats = _traffic("grad_stats", lambda mem: (grads(mem, spec), torch.tensor(0.5), 2.0))
    adam = _traffic(
        "adam_step_",
        _adam_build(spec, amsgrad=False, master=False, decoupled=True, maximize=False,
                    lr_tensor=False, found=0.0, clip=0.5),
    )  # fmt: skip
    if offset == 2:
        assert stats == adam == {"loads": 0, "stores": 0, "load_bytes": 0, "store_bytes": 0}
        return
    assert stats == {"loads": total // 4, "stores": 0, "load_bytes": 4 * total, "store_bytes": 0}
    assert adam["load_bytes"] == 16 * total and adam["store_bytes"] == 12 * total, adam
    assert adam["loads"] == total and adam["stores"] == 3 * total // 4, adam


# The step ops' held variants (csrc/common/held_tensors.h): run_case sends every case of the
# list-taking op through its held variant too, on the CPU kernel and on the emulator.
HELD = {
    "adam_step_": "adam_step_held_",
    "sgd_step_": "sgd_step_held_",
    "adam_lowbit_step_": "adam_lowbit_step_held_",
    "sgd_lowbit_step_": "sgd_lowbit_step_held_",
}


def test_every_held_variant_runs_with_its_list_ops_cases():
    assert {n for n in emu.fastamp_ops() if n.endswith("_held_")} == set(HELD.values())
    for op, held in HELD.items():
        assert held_variant(op) == held
    emu.load()
    for name in ("hold_tensors", "release_tensors", "held_moved"):
        qualname = f"fastamp_emu::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd")
