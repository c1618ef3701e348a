"""Shared fixtures for the optimizer tests: params spread over several meshes, and references.

The layout uses three meshes on 4 ranks: a 1-D world mesh, the 2-D (dp, tp) mesh, and its
``tp`` sub-mesh. Shapes are chosen so that several shards are uneven (7 rows over 4 ranks).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

# (name, mesh key, shape, placements)
PARAM_LAYOUT = [
    ("world_s0_uneven", "world", (7, 3), (Shard(0),)),
    ("world_rep", "world", (4, 2), (Replicate(),)),
    ("world_s1", "world", (3, 9), (Shard(1),)),
    ("tp_s0_uneven", "tp", (7, 2), (Shard(0),)),
    ("tp_rep", "tp", (5,), (Replicate(),)),
    ("mesh2d_s0_s1", "2d", (6, 5), (Shard(0), Shard(1))),
    ("mesh2d_rep_s0", "2d", (7, 4), (Replicate(), Shard(0))),
]


def build_meshes(device_type: str = "cpu") -> dict:
    mesh2d = init_device_mesh(device_type, (2, 2), mesh_dim_names=("dp", "tp"))
    world = init_device_mesh(device_type, (4,), mesh_dim_names=("world",))
    return {"world": world, "2d": mesh2d, "tp": mesh2d["tp"]}


def full_params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _, _, shape, _ in PARAM_LAYOUT]


def full_grads(step: int, seed: int = 100) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + step)
    return [torch.randn(shape, generator=gen) for _, _, shape, _ in PARAM_LAYOUT]


def distribute(full: list[torch.Tensor], meshes: dict) -> list:
    return [
        distribute_tensor(t, meshes[key], list(placements))
        for t, (_, key, _, placements) in zip(full, PARAM_LAYOUT)
    ]


def partial_grad(full: torch.Tensor, mesh, rank: int, world: int):
    """A ``Partial`` DTensor whose sum over ``mesh`` equals ``full`` (rank-dependent pieces)."""
    from torch.distributed.tensor import DTensor

    weight = (rank + 1) / sum(range(1, world + 1))
    return DTensor.from_local(full * weight, mesh, [Partial()] * mesh.ndim, run_check=False)


# (label, optimizer class name, kwargs): every option each optimizer has.
OPTIM_CASES = [
    ("adam", "Adam", {"lr": 0.01}),
    ("adam_amsgrad_wd", "Adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    ("adam_maximize_tlr", "Adam", {"lr": torch.tensor(0.02), "maximize": True}),
    ("adamw", "AdamW", {"lr": 0.01, "weight_decay": 0.05}),
    ("adamw_amsgrad_tlr", "AdamW", {"lr": torch.tensor(0.01), "amsgrad": True}),
    ("adamw_maximize", "AdamW", {"lr": 0.01, "maximize": True, "betas": (0.8, 0.9)}),
    ("sgd", "SGD", {"lr": 0.1}),
    ("sgd_momentum_nesterov", "SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("sgd_dampening_wd_max", "SGD", {"lr": 0.1, "momentum": 0.5, "dampening": 0.3,
                                     "weight_decay": 0.01, "maximize": True}),
    ("sgd_tlr", "SGD", {"lr": torch.tensor(0.05), "momentum": 0.9}),
    ("adagrad", "Adagrad", {"lr": 0.1}),
    ("adagrad_decay_wd_max", "Adagrad", {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1,
                                         "maximize": True}),
    ("adagrad_tlr", "Adagrad", {"lr": torch.tensor(0.1), "initial_accumulator_value": 0.1}),
]


def make_optimizer(cls_name: str, params, kwargs: dict, impl: str):
    """``impl`` is 'fused', 'foreach' or 'forloop'."""
    kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    if impl != "fused" and isinstance(kwargs.get("lr"), torch.Tensor):
        kwargs["lr"] = kwargs["lr"].item()  # torch needs capturable=True for a tensor lr there
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True},
             "forloop": {"foreach": False}}[impl]
    return getattr(torch.optim, cls_name)(params, **kwargs, **flags)


@contextlib.contextmanager
def handler_calls():
    """Count, by overload, the calls that reach dtensor_moe's fused-optimizer handler in the
    block: a counting wrapper sits in DTensor's handler table for the block only."""
    from dtensor_moe import _compat
    from dtensor_moe.optim.fused import FUSED_OPS, fused_optimizer_handler

    calls: collections.Counter = collections.Counter()

    def counting(op, args, kwargs):
        calls[str(op)] += 1
        return fused_optimizer_handler(op, args, kwargs)

    handlers = _compat.custom_op_handlers()
    for op in FUSED_OPS:
        handlers[op] = counting
    try:
        yield calls
    finally:
        for op in FUSED_OPS:
            handlers[op] = fused_optimizer_handler


def plain_copies(dtensors: list) -> list:
    """Plain-tensor params holding clones of this rank's local shards (and of their grads).

    Stepped by torch.optim, they give torch's own result on exactly the local data that the
    DTensor step works on, without running any code of dtensor_moe.
    """
    out = []
    for p in dtensors:
        q = torch.nn.Parameter(p.to_local().detach().clone())
        if p.grad is not None:
            q.grad = p.grad.to_local().detach().clone()
        out.append(q)
    return out
