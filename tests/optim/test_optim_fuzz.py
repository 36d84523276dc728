"""Property-based fuzzing of the fused optimizer ops, adam_step_ and sgd_step_.

Every tensor lives inside a larger guard buffer. A valid example must match the float64 textbook
rule within the rounding the fp32 kernel can make (an error bound computed per element from the
reference's own magnitudes) plus one rounding to the storage dtype, leave every byte outside the
tensors alone, and advance the step counters; an overflowed step (found_inf != 0) must write
nothing at all; an invalid one must raise an error naming the argument, with nothing written.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from hypothesis import event
from hypothesis import strategies as st

from fastamp.testing import adam_ref, op_args, sgd_ref
from tests import _fuzz as fuzz

EPS32 = 2.0**-24
OPTIONAL_SCALARS = ("lr_tensor", "inv_scale", "found_inf", "clip_coef")
DEFECT_KINDS = (
    "param_layout",
    "param_dtype",
    "grad_strides",
    "grad_shape",
    "grad_dtype",
    "state_dtype",
    "state_shape",
    "state_strides",
    "step_dtype",
    "step_numel",
    "master_dtype",
    "list_len",
    "device",
    "scalar_dtype",
    "scalar_numel",
    "scalar_device",
    "momentum_buffers",
)


# --- cases --------------------------------------------------------------------------------------


@st.composite
def step_cases(draw, kind: str):
    """A whole optimizer call: per-param specs for every list, optional device scalars,
    hyperparameters, and at most a few deliberate defects (with the names an error must carry)."""
    device = draw(st.sampled_from(fuzz.compute_devices()))
    n = draw(st.integers(0, 4))
    master = draw(st.booleans())
    if kind == "adam":
        amsgrad = draw(st.booleans())
        state_names = ["exp_avgs", "exp_avg_sqs"] + (["max_exp_avg_sqs"] if amsgrad else [])
        hp = dict(
            lr=draw(st.floats(1e-4, 0.1)),
            beta1=draw(st.sampled_from([0.0, 0.5, 0.9, 0.99])),
            beta2=draw(st.sampled_from([0.9, 0.99, 0.999, 0.9999])),
            eps=draw(st.sampled_from([1e-8, 1e-6, 1e-3])),
            weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])),
            amsgrad=amsgrad,
            decoupled=draw(st.booleans()),
            maximize=draw(st.booleans()),
        )
    else:
        momentum = draw(st.sampled_from([0.0, 0.0, 0.5, 0.9]))
        state_names = ["momentum_buffers"] if momentum else []
        hp = dict(
            lr=draw(st.floats(1e-4, 0.5)),
            momentum=momentum,
            dampening=draw(st.sampled_from([0.0, 0.1, 0.5])),
            weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])),
            nesterov=draw(st.booleans()),
            maximize=draw(st.booleans()),
        )
    params, grads, states, masters, steps = [], [], {k: [] for k in state_names}, [], []
    for _ in range(n):
        shape = draw(fuzz.shapes(max_dims=3))
        dtype = draw(st.sampled_from(fuzz.HALF_DTYPES))
        p = draw(
            fuzz.tensor_specs(
                device=device,
                dtypes=(dtype,),
                layouts=fuzz.DENSE_LAYOUTS,
                shape=shape,
                nonfinite=False,
            )
        )
        # Grads are loss-scaled and may hold inf/NaN; state and master share the param's layout.
        g = replace(
            draw(fuzz.tensor_specs(device=device, dtypes=(dtype,), shape=shape)),
            layout=p.layout,
            perm=p.perm,
            steps=p.steps,
            squeeze=(),
        )
        sdt = torch.float32 if master else dtype
        st_specs = {}
        for k in state_names:
            s = replace(
                p,
                seed=draw(st.integers(0, 2**31 - 1)),
                dtype=sdt,
                pre=draw(st.sampled_from([0, 2, 9])),
                magnitude=0.1,
            )
            st_specs[k] = s
        m = replace(p, dtype=torch.float32, seed=p.seed + 1, pre=draw(st.sampled_from([0, 5])))
        params.append(p)
        grads.append(g)
        for k in state_names:
            states[k].append(st_specs[k])
        masters.append(m)
        steps.append(float(draw(st.sampled_from([0, 1, 2, 7, 1000, 2**24]))))
    scalars = {}
    for name in OPTIONAL_SCALARS:
        if draw(st.booleans()):
            if name == "found_inf":
                value = draw(st.sampled_from([0.0, 0.0, 1.0, math.nan, -0.0, 0.5]))
            elif name == "inv_scale":
                value = draw(st.sampled_from([1.0, 2.0**-8, 2.0**-16, 1 / 3000]))
            elif name == "clip_coef":
                value = draw(st.sampled_from([1.0, 0.5, 1e-3]))
            else:
                value = draw(st.floats(1e-4, 0.1))
            scalars[name] = value
    # Defects: at most two kinds (distinct, so that one cannot undo the other), chosen from what
    # the op must refuse.
    kinds = draw(st.lists(st.sampled_from(DEFECT_KINDS), max_size=2, unique=True))
    if draw(st.booleans()):
        kinds = []
    defects = [k + ":" + str(draw(st.integers(0, 1000))) for k in kinds]
    return dict(
        kind=kind,
        device=device,
        params=params,
        grads=grads,
        states=states,
        masters=masters if master else [],
        steps=steps,
        scalars=scalars,
        hp=hp,
        defects=defects,
        master=master,
    )


def _make(case):
    """Builds the tensors of a case, applies its defects; returns (args, names, guarded)."""
    device, n = case["device"], len(case["params"])
    P = [fuzz.build(s) for s in case["params"]]
    G = [fuzz.build(s) for s in case["grads"]]
    S = {k: [fuzz.build(s) for s in v] for k, v in case["states"].items()}
    for k, lst in S.items():  # second moments are non-negative
        if k != "exp_avgs":
            for t in lst:
                if t.base.device.type != "meta":
                    t.base.abs_()
    M = [fuzz.build(s) for s in case["masters"]]
    for m, p in zip(M, P):  # master weights: the fp32 values the half params were cast from
        m.view.copy_(p.view.float() + 1e-3 * m.view)
    steps = [torch.tensor(v, device=device) for v in case["steps"]]
    scalars = {
        k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in case["scalars"].items()
    }
    names: list[str] = []
    extra_lists: dict[str, list] = {}
    momentum_lists = {}
    for d in case["defects"]:
        what, r = d.split(":")
        r = int(r)
        if what.startswith("scalar"):
            if not scalars or n == 0:
                continue
            key = sorted(scalars)[r % len(scalars)]
            t = scalars[key]
            if what == "scalar_dtype":
                scalars[key] = t.double()
            elif what == "scalar_numel":
                scalars[key] = t.reshape(1).expand(2).clone()
            else:
                scalars[key] = t.to(fuzz.foreign_devices(device)[0])
            names.append(key)
            continue
        if what == "momentum_buffers":
            if case["kind"] == "sgd" and case["hp"]["momentum"] == 0 and n:
                momentum_lists["momentum_buffers"] = [torch.zeros_like(p.view) for p in P]
                names.append("momentum_buffers")
            continue
        if n == 0:
            continue
        i = r % n
        lists = {"grads": G, **S}
        if M:
            lists["master_params"] = M
        if what == "param_layout":
            p = P[i]
            if p.view.numel() > 1 and p.view.dim() >= 1:
                P[i] = _as_guarded(
                    p.view[..., ::2] if p.view.shape[-1] > 1 else p.view.expand(2, *p.view.shape), p
                )
                names.append(f"params[{i}]")
                names.append(f"grads[{i}]")  # its shape no longer matches the grad's
                names += [f"{k}[{i}]" for k in S] + ([f"master_params[{i}]"] if M else [])
        elif what == "param_dtype":
            P[i] = _as_guarded(P[i].view.double(), P[i])
            names += [f"params[{i}]", f"grads[{i}]"] + [f"{k}[{i}]" for k in S]
        elif what == "grad_strides":
            g = G[i].view
            if g.dim() >= 2 and g.shape[-1] > 1 and g.shape[-2] > 1:
                G[i] = _as_guarded(
                    g.transpose(-1, -2).contiguous().transpose(-1, -2)
                    if g.is_contiguous()
                    else g.contiguous(),
                    G[i],
                )
                if G[i].view.stride() != P[i].view.stride():
                    names.append(f"grads[{i}]")
        elif what == "grad_shape":
            G[i] = _as_guarded(
                torch.zeros(*G[i].view.shape, 2, dtype=G[i].view.dtype, device=device), G[i]
            )
            names.append(f"grads[{i}]")
        elif what == "grad_dtype":
            G[i] = _as_guarded(G[i].view.double(), G[i])
            names.append(f"grads[{i}]")
        elif what.startswith("state") and S:
            k = sorted(S)[r % len(S)]
            t = S[k][i].view
            if what == "state_dtype":
                S[k][i] = _as_guarded(t.double(), S[k][i])
            elif what == "state_shape":
                S[k][i] = _as_guarded(t.reshape(-1) if t.dim() != 1 else t.reshape(1, -1), S[k][i])
                if S[k][i].view.shape == t.shape:
                    continue
            else:
                if not (t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1):
                    continue
                S[k][i] = _as_guarded(
                    t.transpose(-1, -2).contiguous().transpose(-1, -2)
                    if t.is_contiguous()
                    else t.contiguous(),
                    S[k][i],
                )
                if S[k][i].view.stride() == t.stride():
                    continue
            names.append(f"{k}[{i}]")
        elif what == "step_dtype":
            steps[i] = steps[i].double()
            names.append(f"state_steps[{i}]")
        elif what == "step_numel":
            steps[i] = steps[i].reshape(1).expand(2).clone()
            names.append(f"state_steps[{i}]")
        elif what == "master_dtype" and M:
            M[i] = _as_guarded(M[i].view.half(), M[i])
            names.append(f"master_params[{i}]")
        elif what == "list_len":
            # (An empty master_params list is legal: it means no master weights.)
            k = sorted(x for x in lists if x != "master_params")[r % len(S | {"grads": 0})]
            extra_lists[k] = lists[k][:-1]
            names.append(f"{k} has")
        elif what == "device":
            k = sorted(lists)[r % len(lists)] if r % 3 else "state_steps"
            if k == "state_steps":
                steps[i] = steps[i].to(fuzz.foreign_devices(device)[0])
            else:
                lists[k][i] = _as_guarded(
                    lists[k][i].view.to(fuzz.foreign_devices(device)[0]), lists[k][i]
                )
            names.append(f"{k}[{i}]")
    views = {
        k: [g.view for g in v]
        for k, v in {"params": P, "grads": G, **S, "master_params": M}.items()
    }
    views.update(
        {
            k: [t.view if isinstance(t, fuzz.Guarded) else t for t in v]
            for k, v in extra_lists.items()
        }
    )
    views.update(momentum_lists)
    if n == 0:
        names = [x for x in names if x.endswith(" has")]
    else:
        dev0 = views["params"][0].device
        for k, lst in views.items():
            names += [f"{k}[{j}]" for j, t in enumerate(lst) if t.device != dev0]
        names += [f"state_steps[{j}]" for j, t in enumerate(steps) if t.device != dev0]
        names += [k for k, t in scalars.items() if t.device != dev0]
    guarded = P + G + [t for v in S.values() for t in v] + M
    return views, steps, scalars, names, guarded, (P, G, S, M)


def _as_guarded(t: torch.Tensor, like: fuzz.Guarded) -> fuzz.Guarded:
    """A replacement argument that is not guarded (a defect: it only has to be left alone)."""
    base = t.detach()
    offsets = torch.zeros(t.shape, dtype=torch.int64)
    g = fuzz.Guarded(
        like.spec,
        base.reshape(-1) if base.is_contiguous() else base.clone().reshape(-1),
        t,
        offsets,
    )
    g.snapshot = None
    return g


def _call(case, views, steps, scalars):
    hp = case["hp"]
    sc = {k: scalars.get(k) for k in OPTIONAL_SCALARS}
    if case["kind"] == "adam":
        return lambda: torch.ops.fastamp.adam_step_(*op_args(
            "adam_step_", params=views["params"], grads=views["grads"],
            exp_avgs=views["exp_avgs"] if "exp_avgs" in views else [],
            exp_avg_sqs=views["exp_avg_sqs"] if "exp_avg_sqs" in views else [],
            max_exp_avg_sqs=views.get("max_exp_avg_sqs", []), state_steps=steps,
            master_params=views["master_params"], lr=hp["lr"], lr_tensor=sc["lr_tensor"],
            beta1=hp["beta1"], beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"],
            amsgrad=hp["amsgrad"], decoupled_weight_decay=hp["decoupled"], maximize=hp["maximize"],
            inv_scale=sc["inv_scale"], found_inf=sc["found_inf"],
            clip_coef=sc["clip_coef"]))  # fmt: skip
    return lambda: torch.ops.fastamp.sgd_step_(*op_args(
        "sgd_step_", params=views["params"], grads=views["grads"],
        momentum_buffers=views.get("momentum_buffers", []), state_steps=steps,
        master_params=views["master_params"], lr=hp["lr"], lr_tensor=sc["lr_tensor"],
        weight_decay=hp["weight_decay"], momentum=hp["momentum"], dampening=hp["dampening"],
        nesterov=hp["nesterov"], maximize=hp["maximize"], inv_scale=sc["inv_scale"],
        found_inf=sc["found_inf"], clip_coef=sc["clip_coef"]))  # fmt: skip


# --- oracle -------------------------------------------------------------------------------------


def _assert_bound(
    got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, dtype, what: str, mask: torch.Tensor
) -> None:
    """|got - ref| <= bound + 1 ulp of the storage dtype, on the elements in ``mask``; a value whose
    allowed range reaches past the dtype's largest finite one may have rounded to inf."""
    g, r, b = got.double().reshape(-1)[mask], ref.reshape(-1)[mask], bound.reshape(-1)[mask]
    both_nan = g.isnan() & r.isnan()
    err = (g - r).abs()
    tol = b + fuzz.ulp(r, dtype)
    overflow = g.isinf() & (g.sign() == r.sign()) & (r.abs() + tol > torch.finfo(dtype).max)
    bad = ~both_nan & ~overflow & ~(err <= tol)
    if bool(bad.any()):
        j = bad.nonzero().reshape(-1)[0]
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements off, e.g. {float(g[j])!r} vs "
            f"{float(r[j])!r} (allowed {float(tol[j]):.3g})"
        )


def _check_step(case):
    views, steps, scalars, names, guarded, (P, G, S, M) = _make(case)
    for g in guarded:
        g.freeze()
    steps_before = [s.clone() for s in steps]
    call = _call(case, views, steps, scalars)
    if names:
        event("rejected")
        fuzz.expect_error(call, names, guarded)
        for s, b in zip(steps, steps_before):
            if s.device.type != "meta":
                assert torch.equal(fuzz.bits(s.cpu()), fuzz.bits(b.cpu())), "a step counter moved"
        return
    before = {id(g): g.values() for g in guarded}
    call()
    if not P or P[0].view.device.type == "meta":
        event("no params" if not P else "meta")
        return
    for g in G:
        g.assert_untouched("grads (read-only)")
    found = case["scalars"].get("found_inf")
    if found is not None and found != 0:  # overflowed step: nothing written at all
        event("skipped step (found_inf)")
        for g in guarded:
            g.assert_untouched("after a skipped step:")
        for s, b in zip(steps, steps_before):
            assert torch.equal(s, b)
        return
    event(f"updated {sum(p.view.numel() > 0 for p in P)} non-empty params")
    for s, b in zip(steps, steps_before):
        assert float(s) == float(b) + 1.0 or (float(b) >= 2**24 and float(s) == float(b)), "step"
    hp, sc = case["hp"], case["scalars"]
    lr = sc.get("lr_tensor", hp["lr"])
    lr = float(torch.tensor(lr, dtype=torch.float32)) if "lr_tensor" in sc else lr
    inv = float(torch.tensor(sc.get("inv_scale", 1.0), dtype=torch.float32))
    coef = float(torch.tensor(sc.get("clip_coef", 1.0), dtype=torch.float32))
    for i, p in enumerate(P):
        if p.view.numel() == 0:
            continue
        g0 = before[id(G[i])]
        finite = torch.isfinite(g0).reshape(-1)
        master = M[i] if M else None
        p0 = before[id(master)] if master is not None else before[id(p)]
        gu = g0.double() * inv * coef
        if case["kind"] == "adam":
            m0 = before[id(S["exp_avgs"][i])]
            v0 = before[id(S["exp_avg_sqs"][i])]
            vm0 = before[id(S["max_exp_avg_sqs"][i])] if hp["amsgrad"] else None
            step = float(steps_before[i]) + 1
            adam_hp = ("beta1", "beta2", "eps", "weight_decay", "amsgrad", "decoupled", "maximize")
            ep, em, ev, evm = adam_ref(
                p0, g0, m0, v0, vm0, step, lr=lr, inv_scale=inv, clip_coef=coef,
                **{k: hp[k] for k in adam_hp},
            )  # fmt: skip
            # fp32 error bound of the kernel: the gradient's and the moments' roundings, the
            # lerp's cancellation, and the update's few operations, each a few units of 2^-24.
            bc1 = 1 - hp["beta1"] ** step
            bc2 = 1 - hp["beta2"] ** step
            gabs = gu.abs() + hp["weight_decay"] * p0.double().abs()
            vhat = evm if hp["amsgrad"] else ev
            denom = vhat.sqrt() / math.sqrt(bc2) + hp["eps"]
            size = lr / bc1
            bound_m = 8 * EPS32 * (m0.double().abs() + gabs)
            bound_v = 8 * EPS32 * (v0.double().abs() + gabs * gabs)
            bound_p = (
                16 * EPS32 * (p0.double().abs() + size * (em.abs() + bound_m / EPS32 / 8) / denom)
            )
            checks = [(S["exp_avgs"][i], em, bound_m), (S["exp_avg_sqs"][i], ev, bound_v)]
            if hp["amsgrad"]:
                checks.append((S["max_exp_avg_sqs"][i], evm, bound_v))
        else:
            buf0 = before[id(S["momentum_buffers"][i])] if hp["momentum"] else None
            first = float(steps_before[i]) == 0.0
            sgd_hp = ("momentum", "dampening", "weight_decay", "nesterov", "maximize")
            ep, eb = sgd_ref(
                p0, g0, buf0, first, lr=lr, inv_scale=inv, clip_coef=coef,
                **{k: hp[k] for k in sgd_hp},
            )  # fmt: skip
            gabs = gu.abs() + hp["weight_decay"] * p0.double().abs()
            babs = gabs + (buf0.double().abs() * hp["momentum"] if buf0 is not None else 0)
            bound_b = 8 * EPS32 * babs
            bound_p = 16 * EPS32 * (p0.double().abs() + lr * (gabs + babs * (1 + hp["momentum"])))
            checks = [(S["momentum_buffers"][i], eb, bound_b)] if hp["momentum"] else []
        target = master if master is not None else p
        checks.append((target, ep, bound_p))
        if master is not None:
            checks.append((p, ep, bound_p))  # params = cast(master)
        for t, ref, bound in checks:
            got = t.values()
            _assert_bound(
                got,
                ref.double(),
                bound.double(),
                t.spec.dtype if t is not p else p.spec.dtype,
                f"{case['kind']} param {i} ({t.spec.dtype})",
                finite,
            )
            # Where the (scaled) gradient was inf/NaN and no found_inf skipped the step, the
            # update must not come out finite.
            if not bool(finite.all()) and t is target:
                assert bool((~torch.isfinite(got.reshape(-1)[~finite])).all()), (
                    "non-finite grad vanished"
                )
    for g in guarded:
        g.assert_outside_untouched("optimizer state")


def _check_adam_step(case):
    """adam_step_ against the float64 Adam/AdamW rule (see the module docstring)."""
    _check_step(case)


def _check_sgd_step(case):
    """sgd_step_ against the float64 SGD rule (see the module docstring)."""
    _check_step(case)


test_adam_step, test_adam_step_slow = fuzz.tiered(default=100, slow=4000, case=step_cases("adam"))(
    _check_adam_step
)
test_sgd_step, test_sgd_step_slow = fuzz.tiered(default=120, slow=4000, case=step_cases("sgd"))(
    _check_sgd_step
)


def test_empty_step_is_a_no_op():
    """Empty lists and no optional tensor: nothing to dispatch on, nothing to do (it used to be the
    dispatcher's "no fallback function is registered" NotImplementedError)."""
    torch.ops.fastamp.adam_step_(*op_args(
        "adam_step_", params=[], grads=[], exp_avgs=[], exp_avg_sqs=[], state_steps=[],
        lr=1e-3))  # fmt: skip
    torch.ops.fastamp.sgd_step_(*op_args(
        "sgd_step_", params=[], grads=[], momentum_buffers=[], state_steps=[],
        momentum=0.0))  # fmt: skip
    fuzz.expect_error(lambda: torch.ops.fastamp.sgd_step_(*op_args(
        "sgd_step_", params=[], grads=[torch.ones(2)], momentum_buffers=[], state_steps=[],
        momentum=0.0)), ["grads given without params"])  # fmt: skip


def test_meta_tensor_in_any_list_is_rejected():
    """A meta tensor in any list dispatches to the fake kernel, which used to check only grads and
    exp_avgs and otherwise returned: a silent no-op step."""
    p, g = [torch.randn(4)], [torch.randn(4)]
    snap = p[0].clone()
    meta = torch.zeros(4, device="meta")
    step = [torch.zeros(())]
    args = dict(lr=0.1, beta1=0.9, beta2=0.99, wd=0.0, eps=1e-8)

    def adam(m, v, steps, lr_t=None):
        torch.ops.fastamp.adam_step_(*op_args(
            "adam_step_", params=p, grads=g, exp_avgs=m, exp_avg_sqs=v, state_steps=steps,
            lr=args["lr"], lr_tensor=lr_t, beta1=args["beta1"], beta2=args["beta2"],
            weight_decay=args["wd"], eps=args["eps"]))  # fmt: skip

    fuzz.expect_error(lambda: adam([torch.zeros(4)], [meta], step), ["exp_avg_sqs[0]"])
    fuzz.expect_error(
        lambda: adam([torch.zeros(4)], [torch.zeros(4)], [torch.zeros((), device="meta")]),
        ["state_steps[0]"],
    )
    fuzz.expect_error(
        lambda: adam([torch.zeros(4)], [torch.zeros(4)], step, torch.tensor(0.1, device="meta")),
        ["lr_tensor"],
    )
    fuzz.expect_error(lambda: torch.ops.fastamp.sgd_step_(*op_args(
        "sgd_step_", params=p, grads=g, momentum_buffers=[meta],
        state_steps=step)), ["momentum_buffers[0]"])  # fmt: skip
    assert torch.equal(p[0], snap) and float(step[0]) == 0.0
