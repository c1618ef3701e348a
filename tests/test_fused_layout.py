"""Single-process tests: schema lookup of argument positions, coverage and idempotent registration."""

from __future__ import annotations

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


_IN_PLACE = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")


@pytest.mark.parametrize("name", EXPECTED_OPS)
def test_kernel_is_torchs_binding_or_the_overload(name):
    # The handler calls torch's own Python binding for the in-place ops (it picks the overload
    # from the type of lr, as the dispatcher did) and the overload itself for the others; it
    # reads the binding from torch and never replaces it.
    op = _op(name)
    packet = op.overloadpacket.__name__
    kernel = fused_op_layout(op).kernel
    if packet in _IN_PLACE:
        assert kernel is getattr(torch._C._VariableFunctions, packet)
        assert getattr(torch, packet) is kernel
    else:
        assert kernel is op


def test_plain_tensors_never_reach_the_handler():
    from tests._optim_cases import handler_calls

    p, g = [torch.ones(3)], [torch.full((3,), 0.5)]
    with handler_calls() as calls:
        torch._fused_sgd_(p, g, [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=True)
    assert calls == {}
    assert torch.allclose(p[0], torch.full((3,), 0.95))
