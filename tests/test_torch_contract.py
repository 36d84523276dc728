"""The contract with torch's private names: every private attribute, method and helper of torch that
fastamp's Python side overrides or reads still exists, with the signature fastamp assumes.

fastamp.GradScaler and fastamp's DDP subclass torch's classes, so torch's own methods call
fastamp's overrides and read the attributes both share. torch moves privates between releases
(torch 2.11's DDP had no ``broadcast_buffers`` attribute); run across the torch matrix
(``make test-matrix``), this file names the break instead of leaving it to a user's run time.

The attribute lists are not written by hand: each is read from the fastamp classes of the
subclass's MRO (a ``self._x`` they read and none of them declares or assigns is the torch
base's), so a new dependency is covered the day it is written.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastamp
from fastamp.parallel import DistributedDataParallel

PY = pathlib.Path(fastamp.__file__).resolve().parent


def _self_reads_and_declarations(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(``self._x`` names read, names the classes own: methods, class attributes, annotations and
    ``self._x`` assignments) over the class definitions in ``tree``."""
    reads: set[str] = set()
    declared: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                declared.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                declared.add(item.target.id)
            elif isinstance(item, ast.Assign):
                declared.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                (reads if isinstance(node.ctx, ast.Load) else declared).add(node.attr)
    return reads, declared


def torch_owned_reads(fastamp_cls: type) -> set[str]:
    """The ``self._x`` names that the fastamp classes in ``fastamp_cls``'s MRO read but none of
    them owns (declares or assigns): attributes of the torch base class, which its ``__init__`` and
    methods create and use."""
    reads: set[str] = set()
    declared: set[str] = set()
    for cls in fastamp_cls.__mro__:
        if cls.__module__.startswith("fastamp"):
            r, d = _self_reads_and_declarations(ast.parse(textwrap.dedent(inspect.getsource(cls))))
            reads |= r
            declared |= d
    return reads - declared


def _has(obj: object, name: str) -> bool:
    return hasattr(obj, name) or name in getattr(obj, "__dict__", {})


def test_owned_read_scanner_separates_torchs_names_from_ours():
    tree = ast.parse(
        "class A(Base):\n"
        "    _declared: int\n"
        "    _class_attr = 3\n"
        "    def _mine(self):\n"
        "        self._ours = 1\n"
        "        return self._declared + self._class_attr + self._mine() + self._theirs\n"
    )
    reads, declared = _self_reads_and_declarations(tree)
    assert reads == {"_declared", "_class_attr", "_mine", "_theirs"}
    assert declared == {"_declared", "_class_attr", "_mine", "_ours"}
    assert reads - declared == {"_theirs"}


# --- GradScaler -------------------------------------------------------------------------------

# The torch.amp.GradScaler methods fastamp.GradScaler overrides (torch's public methods call them).
_SCALER_OVERRIDES = [
    "_unscale_grads_",
    "_maybe_opt_step",
    "_check_inf_per_device",
    "_lazy_init_scale_growth_tracker",
    # torch's own, with its messages, rewritten so torch.compile traces it (dynamo does not trace
    # into torch.amp.GradScaler's methods); torch's public methods (scale, unscale_) call it too.
    "_check_scale_growth_tracker",
]


def _positional_names(fn) -> list[str]:
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


@pytest.mark.parametrize("name", _SCALER_OVERRIDES)
def test_the_scaler_methods_fastamp_overrides_exist_in_torch_with_the_same_arguments(name):
    theirs = getattr(torch.amp.GradScaler, name, None)
    assert theirs is not None, f"torch.amp.GradScaler.{name} is gone: fastamp overrides it"
    ours = getattr(fastamp.GradScaler, name)
    assert ours is not theirs, f"fastamp.GradScaler no longer overrides {name}"
    # torch's callers pass torch's arguments: ours must take them, in torch's order.
    assert _positional_names(ours)[: len(_positional_names(theirs))] == _positional_names(theirs)


def test_every_scaler_override_of_a_torch_private_is_listed_above():
    overrides = {
        name
        for cls in fastamp.GradScaler.__mro__
        if cls.__module__.startswith("fastamp")
        for name in vars(cls)
        if name.startswith("_")
        and not name.startswith("__")
        and hasattr(torch.amp.GradScaler, name)
    }
    assert overrides == set(_SCALER_OVERRIDES)


def test_the_per_optimizer_state_keeps_torchs_keys_and_stages():
    from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

    assert {s.name for s in OptState} >= {"READY", "UNSCALED", "STEPPED"}
    assert set(_refresh_per_optimizer_state()) == {"stage", "found_inf_per_device"}
    assert _refresh_per_optimizer_state()["stage"] is OptState.READY


def test_torch_still_honours_the_optimizer_flag_fastamp_sets():
    # fastamp's optimizers set _step_supports_amp_scaling so torch's scaler hands them the step.
    assert "_step_supports_amp_scaling" in inspect.getsource(torch.amp.GradScaler.step)


def test_the_scaler_attributes_fastamp_reads_exist_on_torchs_scaler():
    # What fastamp reads without owning it: undeclared reads (none, as test_architecture asks)
    # and the class-body declarations of torch's attributes.
    names = torch_owned_reads(fastamp.GradScaler) | set(
        vars(fastamp.GradScaler).get("__annotations__", {})
    )
    assert {"_scale", "_growth_tracker"} <= names  # the scan sees ones we know about
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.step(opt)  # every lazily created attribute now exists
    missing = sorted(n for n in names if not _has(scaler, n))
    assert not missing, (
        f"fastamp reads these torch.amp.GradScaler privates, gone in this torch: {missing}"
    )
    # fastamp.resume reads a torch scaler's per-optimizer stages (it has no public accessor), and
    # fastamp.GradScaler writes the same dict torch's methods read.
    assert set(scaler._per_optimizer_states[id(opt)]) == {"stage", "found_inf_per_device"}


# --- DDP --------------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_ddp_attributes_fastamp_reads_exist_on_torchs_ddp(one_rank_group):
    names = torch_owned_reads(DistributedDataParallel)
    torch_ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    torch_ddp(torch.randn(3, 4)).sum().backward()
    missing = sorted(n for n in names if not _has(torch_ddp, n))
    assert not missing, (
        f"fastamp's DDP reads these torch DDP privates, gone in this torch: {missing}"
    )
    # The methods of torch's DDP that run on fastamp's instance (through its inherited forward and
    # state) find what they read there.
    ours = DistributedDataParallel(nn.Linear(4, 2))
    ours(torch.randn(3, 4)).sum().backward()


def test_the_ddp_helpers_fastamp_reads_exist(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Linear(4, 2)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["bias"])
    assert set(model._ddp_params_and_buffers_to_ignore) == {"bias"}
    mesh = init_device_mesh("cpu", (1,))
    assert mesh._get_root_mesh() == mesh
    assert callable(torch.autograd.Variable._execution_engine.queue_callback)


def test_the_autograd_engine_privates_fastamps_ddp_reads_answer_as_it_assumes():
    """DDP's output pre-hook reads the current graph task and asks whether the pass runs a
    parameter's grad accumulator (a gradient penalty's autograd.grad w.r.t. the input does not)."""
    w = nn.Parameter(torch.ones(3))
    acc = w.view_as(w).grad_fn.next_functions[0][0]
    seen: list[tuple[int, bool]] = []
    x = torch.ones(3, requires_grad=True)
    out = (w * x).sum() * 1.0
    out.grad_fn.register_prehook(
        lambda g: seen.append(
            (torch._C._current_graph_task_id(), torch._C._will_engine_execute_node(acc))
        )
    )
    torch.autograd.grad(out, x, retain_graph=True)
    out.backward()
    assert [s[1] for s in seen] == [False, True]
    assert seen[0][0] != seen[1][0] and seen[0][0] >= 0
    assert torch._C._current_graph_task_id() == -1  # outside a backward


# --- tensors, DTensor, checkpoint -------------------------------------------------------------


def test_the_tensor_privates_fastamp_reads_exist():
    t = torch.zeros(3)
    v = t._version
    t.add_(1)
    assert t._version == v + 1
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,)).coalesce()
    assert torch.equal(sparse._values(), torch.tensor([1.0, 2.0]))


def test_dtensor_keeps_its_local_shard_in_local_tensor(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    d = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
    assert d._local_tensor.data_ptr() == d.to_local().data_ptr()


def test_the_checkpoint_generator_fastamp_uses_has_the_signature_it_checks():
    gen = getattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", None)
    if gen is None:
        pytest.skip("this torch has no generator: fastamp falls back to the public checkpoint")
    params = list(inspect.signature(gen).parameters)
    assert params[:2] == ["fn", "preserve_rng_state"], params
