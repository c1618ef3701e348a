"""Single-process tests: schema lookup of argument positions, coverage and idempotent registration."""

from __future__ import annotations

import inspect
import pytest
import torch

import dtensor_moe
from dtensor_moe import _compat
from dtensor_moe.optim.fused import FUSED_OPS, fused_op_layout, fused_optimizer_handler

aten = torch.ops.aten

# Expected schema positions, written out by hand from native_functions.yaml for torch 2.13.
_ADAM_LISTS = ["self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"]
_SGD_LISTS = ["self", "grads", "momentum_buffer_list"]
_ADAGRAD_LISTS = ["self", "grads", "state_sums", "state_steps"]
_LISTS = {"adam": _ADAM_LISTS, "adamw": _ADAM_LISTS, "sgd": _SGD_LISTS, "adagrad": _ADAGRAD_LISTS}
_SCALARS = {"default": ["grad_scale", "found_inf"], "out": ["grad_scale", "found_inf"],
            "tensor_lr": ["lr", "grad_scale", "found_inf"],
            "tensor_lr_out": ["lr", "grad_scale", "found_inf"]}
_RESULTS = {"adam": 5, "adamw": 5, "sgd": 3, "adagrad": 4}

EXPECTED_OPS = [
    f"{packet}{suffix}.{ov}"
    for packet in ("adam", "adamw", "sgd", "adagrad")
    for suffix, ovs in (("_", ("default", "tensor_lr")),
                        ("", ("default", "tensor_lr", "out", "tensor_lr_out")))
    for ov in ovs
]


def _op(name: str):
    packet, ov = name.split(".")
    return getattr(getattr(aten, f"_fused_{packet}"), ov)


def test_every_fused_overload_is_covered():
    assert sorted(str(op) for op in FUSED_OPS) == sorted(f"aten._fused_{n}" for n in EXPECTED_OPS)
    assert len(FUSED_OPS) == 24
    handlers = _compat.custom_op_handlers()
    assert all(handlers[op] is fused_optimizer_handler for op in FUSED_OPS)


@pytest.mark.parametrize("name", EXPECTED_OPS)
def test_argument_positions_found_by_name(name):
    op = _op(name)
    packet = name.split(".")[0].rstrip("_")
    overload = name.split(".")[1]
    layout = fused_op_layout(op)
    lists = list(_LISTS[packet]) + (["out"] if overload.endswith("out") else [])
    assert [n for n, _, _ in layout.list_args] == lists
    positions = {n: pos for n, pos, _ in layout.list_args}
    assert [positions[arg] for arg in _LISTS[packet]] == list(range(len(_LISTS[packet])))
    if "state_steps" in lists:
        assert positions["state_steps"] == (3 if packet == "adagrad" else 5)
    assert [n for n, _, _ in layout.scalar_args] == _SCALARS[overload]
    assert all(kw_only for _, _, kw_only in layout.scalar_args)
    # `out` is keyword-only, everything else in the lists is positional
    assert all(kw == (n == "out") for n, _, kw in layout.list_args)
    in_place = name.split(".")[0].endswith("_")
    n_results = 0 if (in_place or overload.endswith("out")) else _RESULTS[packet]
    if packet == "adagrad" and overload == "tensor_lr" and not in_place:
        n_results = 3  # torch's schema returns no state_steps_out here
    assert layout.num_result_lists == n_results


def test_registration_is_idempotent():
    handlers = _compat.custom_op_handlers()
    before = dict(handlers)
    dtensor_moe.register_strategies()
    dtensor_moe.register_strategies()
    assert handlers == before
    scaler_op = aten._amp_foreach_non_finite_check_and_unscale_.default
    from dtensor_moe.optim.scaler import found_inf_handler

    assert handlers[scaler_op] is found_inf_handler


_ENTRY_NAMES = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")


def _step_body(cls):
    """What ``cls.step`` runs inside torch's ``_use_grad`` wrapper (Note [Fast step])."""
    return _compat.optimizer_step_body_cell(cls).cell_contents


def _our_pre_hooks() -> int:
    """How many times dtensor_moe's fast-step pre-hook is registered."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from dtensor_moe.optim.fast_step import _arm_fast_step

    return sum(h is _arm_fast_step for h in _global_optimizer_pre_hooks.values())


def test_fast_entries_wrap_torch_functions_once():
    for name in _ENTRY_NAMES:
        torchs = getattr(torch._C._VariableFunctions, name)
        assert getattr(torch, name).__wrapped__ is torchs
        dtensor_moe.register_strategies()
        # re-registering wraps the original again, never the wrapper
        assert getattr(torch, name).__wrapped__ is torchs


def test_set_fast_paths_restores_torchs_objects_and_back():
    from dtensor_moe.optim import fast_paths_enabled, set_fast_paths
    from dtensor_moe.optim.fast_step import FAST_STEP_CLASSES

    grouping = "_group_tensors_by_device_and_dtype"
    steps = {cls: cls.step for cls in FAST_STEP_CLASSES}
    handlers = dict(_compat.custom_op_handlers())
    assert fast_paths_enabled()
    assert _our_pre_hooks() == 1
    set_fast_paths(False)
    try:
        assert not fast_paths_enabled()
        assert _our_pre_hooks() == 0
        for name in _ENTRY_NAMES:
            assert getattr(torch, name) is getattr(torch._C._VariableFunctions, name)
        original = torch.optim.Optimizer.__dict__[grouping]
        assert type(original) is staticmethod
        assert original.__func__.__module__ == "torch.optim.optimizer"
        assert not hasattr(original.__func__, "__wrapped__")
        for cls in FAST_STEP_CLASSES:
            assert cls.step is steps[cls]  # never replaced, in either mode
            assert _step_body(cls) is inspect.unwrap(cls.step)  # torch's undecorated body
        dtensor_moe.register_strategies()  # keeps them off
        assert torch._fused_adam_ is torch._C._VariableFunctions._fused_adam_
        assert dict(_compat.custom_op_handlers()) == handlers  # the correctness handlers stay
        set_fast_paths(False)  # idempotent
        assert torch.optim.Optimizer.__dict__[grouping] is original
    finally:
        set_fast_paths(True)
    assert torch.optim.Optimizer.__dict__[grouping] is not original
    assert torch.optim.Optimizer.__dict__[grouping].__func__.__wrapped__ is original.__func__
    assert _our_pre_hooks() == 1
    for cls in FAST_STEP_CLASSES:  # at rest, in either mode: torch's own body (Note [Fast step])
        assert _step_body(cls) is inspect.unwrap(cls.step)
    with pytest.raises(TypeError, match=r"set_fast_paths expects True or False, got 'no'"):
        set_fast_paths("no")


def test_step_hooks_survive_switching_after_torch_wrapped_step():
    # torch wraps Adam.step in its hook wrapper at the first optimizer of the class; switching
    # the fast paths off and on must neither lose nor double the hooks.
    from dtensor_moe.optim import set_fast_paths

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.Adam([p], lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    for enabled in (False, True):
        set_fast_paths(enabled)
        opt.step()
    assert calls == ["pre", "post"] * 2
    assert getattr(torch.optim.Adam.step, "hooked", False)


def test_fast_entry_passes_plain_tensors_to_torch():
    p, g = [torch.ones(3)], [torch.full((3,), 0.5)]
    torch._fused_sgd_(p, g, [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                      nesterov=False, maximize=False, is_first_step=True)
    assert torch.allclose(p[0], torch.full((3,), 0.95))
