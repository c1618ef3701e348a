"""``parallelize_moe``: the whole MoE plan of a model from its :class:`MoEMeshes`.

Note [MoE plan]
~~~~~~~~~~~~~~~
For every :class:`~dtensor_moe.moe.MoE` in the model (see ``docs/parallelism.md``):

==========================  ===============================  =================================
meshes                       experts                          MoE input (tp > 1)
==========================  ===============================  =================================
``tp == 1, ep > 1``          ExpertParallel on ``ep``         plain tensors ("dp2ep")
``tp > 1, expert_tp=False``  ExpertParallel on ``ep``         PrepareMoEInput(routing="split")
``tp > 1, expert_tp=True``   ExpertTensorParallel on          PrepareMoEInput(routing="split"),
                             ``("ep", "etp")``                or "replicate" with
                                                              ``expert_tp_dispatch="gather"``
``tp == 1, ep == 1``         nothing (data parallel only)     plain tensors
==========================  ===============================  =================================

``input_layout`` is ``Shard(1)`` with ``sequence_parallel=True`` and ``Replicate()`` otherwise.
Data parallelism (the ``dp`` dim of the dense mesh and ``edp`` of the expert mesh) is left to
FSDP2 / DDP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from dtensor_moe.moe.balance import check_group_in_stage
from dtensor_moe.moe.layer import MoE
from dtensor_moe.moe.protocol import Router
from dtensor_moe.parallel.mesh import MoEMeshes
from dtensor_moe.routed import exchange_class
from dtensor_moe.parallel.style import (
    ExpertParallel,
    ExpertTensorParallel,
    ExchangeName,
    ExpertTPDispatch,
    PrepareMoEInput,
)

__all__ = ["parallelize_moe"]


def parallelize_moe(
    model: nn.Module,
    meshes: MoEMeshes,
    *,
    sequence_parallel: bool,
    expert_tp_dispatch: ExpertTPDispatch = "all_to_all",
    exchange: ExchangeName = "all_to_all",
    ep_overlap: bool = True,
    exchange_options: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Apply the MoE styles of Note [MoE plan] to every :class:`MoE` in ``model`` (in place).

    Keyword Args:
        sequence_parallel: the MoE inputs are ``Shard(1)`` DTensors on ``meshes.dense["tp"]``
            (``True``) or replicated over tp (``False``: ``Replicate()`` DTensors or plain
            tensors). Ignored when ``tp == 1``.
        expert_tp_dispatch: with ``expert_tp``: ``"all_to_all"`` (each tp rank routes its own
            tokens; the all-to-all replicates rows over the etp ranks) or ``"gather"`` (the tp
            ranks gather the tokens and reduce partial outputs); see
            :class:`~dtensor_moe.parallel.ExpertTensorParallel`.
        exchange: the exchange backend of the expert styles, by registered name or class:
            ``"all_to_all"`` (default) or ``"all_gather"`` (Note [Exchange protocol] in
            ``routed/exchange.py``); see :class:`~dtensor_moe.parallel.ExpertParallel`.
        exchange_options: keyword arguments of the backend's own (``"fixed"``:
            ``buffer_factor``), passed to the expert styles.
        ep_overlap: ``overlap`` of the expert styles: the own rows computed while the other
            rows travel (``True``, default, faster) or every row sent through the exchange
            (``False``); same results. See :class:`~dtensor_moe.parallel.ExpertParallel`.

    Returns:
        ``model``. Collectives: each style's apply-time config check and weight distribution.

    Raises:
        TypeError: ``meshes`` is not an :class:`MoEMeshes`.
        ValueError: ``model`` holds no MoE layer, a module of it is already sharded with
            ``fully_shard`` (call ``parallelize_moe`` first, then ``fully_shard_moe``), a
            router's ``aux_loss_group`` reaches past the meshes' pipeline stage, or a style
            rejects a layer (see the styles).

    Every router of ``model`` records the meshes' pipeline stage (``router.stage_ranks``,
    ``router.pp_rank``), against which the helpers that take a process group check it (Note
    [A router knows its stage] in ``moe/balance.py``).
    """
    try:  # an unknown name: ValueError, before any collective
        backend = exchange_class(exchange)
    except ValueError as err:
        raise ValueError(f"parallelize_moe: {err}") from None
    if not isinstance(meshes, MoEMeshes):
        raise TypeError(
            f"parallelize_moe expects MoEMeshes from build_moe_meshes, got {type(meshes).__name__}"
        )
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"parallelize_moe found no MoE layer in {type(model).__name__}")
    if not backend.static_capacity and any(moe.config.pad_to_capacity for moe in layers):
        raise ValueError(
            f"parallelize_moe: the {backend.name!r} exchange does not support pad_to_capacity "
            "(the static exchange at capacity), which a layer's MoEConfig sets; set "
            "pad_to_capacity=False or use exchange='all_to_all'"
        )
    sharded = _sharded_around(model, layers)
    if sharded:
        raise ValueError(
            f"parallelize_moe: the model is already sharded with fully_shard (FSDP2) (modules "
            f"{sharded[:3]}{' ...' if len(sharded) > 3 else ''}). Call "
            "parallelize_moe (and parallelize_dense) first, then fully_shard_moe"
        )
    _record_stage(layers, meshes)  # before any collective
    global_batch_routers = _unset_global_batch_routers(layers, meshes)  # before any collective
    expert_tp = meshes.expert_tp and meshes.tp > 1
    gather = expert_tp and expert_tp_dispatch == "gather"
    for moe in layers:
        if expert_tp:
            style = ExpertTensorParallel(
                dispatch=expert_tp_dispatch, exchange=exchange, overlap=ep_overlap,
                exchange_options=exchange_options,
            )  # fmt: skip
            parallelize_module(moe.experts, meshes.expert["ep", "etp"], style)
        elif meshes.ep > 1:
            style = ExpertParallel(
                exchange=exchange, overlap=ep_overlap, exchange_options=exchange_options
            )
            parallelize_module(moe.experts, meshes.expert["ep"], style)
        if meshes.tp > 1:
            style = PrepareMoEInput(
                input_layout=Shard(1) if sequence_parallel else Replicate(),
                routing="replicate" if gather else "split",
            )
            parallelize_module(moe, meshes.dense["tp"], style)
    for router in global_batch_routers:
        router.aux_loss_group = _stage_group(meshes)
    return model


def _record_stage(layers: list[MoE], meshes: MoEMeshes) -> None:
    """Record the meshes' pipeline stage on every router (Note [A router knows its stage] in
    ``moe/balance.py``), and refuse an ``aux_loss_group`` set before that reaches past it.
    Local: no collective."""
    stage_ranks = meshes.stage_ranks or tuple(range(dist.get_world_size()))
    for moe in layers:
        moe.router.stage_ranks, moe.router.pp_rank = tuple(stage_ranks), meshes.pp_rank
    for moe in layers:
        check_group_in_stage(
            [moe.router], moe.router.aux_loss_group, "parallelize_moe (aux_loss_group)",
            "Set it with set_aux_loss_group(model, meshes.stage_group), or let "
            "parallelize_moe set it",
        )


def _stage_group(meshes: MoEMeshes) -> dist.ProcessGroup:
    """The ranks that route this stage's share of the global batch: the stage's group under
    pipeline parallelism, every rank otherwise."""
    return meshes.stage_group if meshes.stage_group is not None else dist.group.WORLD


def _sharded_around(model: nn.Module, layers: list[MoE]) -> list[str]:
    """The names of the ``fully_shard`` (FSDP2) modules that hold an MoE layer or sit inside
    one: their params are already sharded for FSDP, so the expert styles cannot apply there.
    FSDP modules elsewhere (say, the embedding sharded first) are no obstacle."""
    inside = {id(sub) for moe in layers for sub in moe.modules()}
    moes = {id(moe) for moe in layers}
    return [
        name or "<root>"
        for name, m in model.named_modules()
        if isinstance(m, FSDPModule)
        and (id(m) in inside or any(id(sub) in moes for sub in m.modules()))
    ]


def _unset_global_batch_routers(layers: list[MoE], meshes: MoEMeshes) -> list[Router]:
    """The routers whose ``"global_batch"`` balance loss (``router.loss_settings``, Note
    [Router protocol] in ``moe/protocol.py``) has no ``aux_loss_group`` yet.

    Note [Global batch under parallelize_moe]: the dense mesh's dp x tp ranks each route
    different tokens of the global batch, and the meshes of ``build_moe_meshes`` cover every
    rank of a pipeline stage, so ``parallelize_moe`` sets those routers' group to the stage's
    ranks (``meshes.stage_group``; ``dist.group.WORLD`` without pipeline parallelism): the loss
    is then the global batch's (per micro-batch under a schedule), as on one device
    (``set_aux_loss_group`` in ``moe/balance.py``). A group set before ``parallelize_moe`` is
    kept; ``set_aux_loss_group(model, None)`` after it goes back to each rank's own batch.
    """
    routers = [
        moe.router
        for moe in layers
        if moe.router.loss_settings.aux_loss_type == "global_batch"
        and moe.router.aux_loss_group is None
    ]
    world = len(meshes.stage_ranks) or dist.get_world_size()
    if routers and meshes.dense.size() != world:
        raise ValueError(
            f"parallelize_moe: a 'global_batch' balance loss reduces over the ranks that route "
            f"the global batch, but the dense mesh {meshes.dense} has {meshes.dense.size()} of the "
            f"{world} ranks; call dtensor_moe.moe.set_aux_loss_group(model, group) with the "
            "group of its dp x tp ranks before parallelize_moe"
        )
    return routers
