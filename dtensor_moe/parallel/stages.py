"""Checks of pipeline stages at setup: unique names across stages, FSDP2 under V schedules.

Note [Stage names]
~~~~~~~~~~~~~~~~~~
Under pipeline parallelism every rank holds the modules of its stage(s), and a checkpoint
(``torch.distributed.checkpoint``) stores each stage's tensors under the keys of its stage
module's ``state_dict``. Those keys are unique over the model only when every stage module keeps
the full model's names: the layers in an ``nn.ModuleDict`` keyed by their index, with what other
stages hold deleted. ``del`` on an ``nn.ModuleList`` renumbers it, so that every stage holds
``layers.0``, ``layers.1``, ...: training runs, but a save writes two stages' tensors under the
same keys (one overwrites the other) and a load gives both stages the same weights, silently.

:func:`check_stage_names` compares the names across the pp ranks with one
``all_gather_object`` over ``meshes.pp_mesh``, so every pp rank must call it the same number of
times, in the same order, each time with its stage's whole module (the one its
``PipelineStage`` runs). ``build_stage`` is where every recipe does that. The per-stage
setup helpers (``parallelize_moe``, ``parallelize_dense``, ``fully_shard_moe``) do not run it:
each acts inside one stage and is legitimately called on some stages only (``parallelize_moe``
not on a stage without MoE layers, ``fully_shard_moe`` on the one stage that uses FSDP2) or on
a part of a stage (one layer at a time), where a gather over the pp ranks would wait for a rank
that never comes, or compare names relative to different roots.

Each call compares the modules passed on this rank with those the other pp ranks pass in the
same call: a rank with two stages (interleaved and V schedules give every rank the same number)
may call once per stage, and its own two modules are then never compared with each other; pass
them together, as a list, to compare every stage with every other. The names are the keys of
``state_dict()``: params and persistent buffers (what a checkpoint holds; ``fully_shard`` and the
parallel styles keep them).

Note [FSDP2 under V schedules]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``reshard_after_forward=True`` torch 2.13's ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` leave some dense grads ``None`` or wrong (a model without MoE layers too),
with no error. ``fully_shard_moe`` therefore keeps the params gathered between forward and
backward by default when ``meshes.pp > 1``, and :func:`check_schedule` refuses a V schedule whose
stages hold an FSDP2 module that reshards after forward; ``overlap_f_b`` runs it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dtensor_moe import _compat
from dtensor_moe.parallel.mesh import MoEMeshes, require_meshes

__all__ = ["check_schedule", "check_stage_names"]

_SHOWN = 8  # names listed in an error message


def _as_modules(modules: nn.Module | Iterable[nn.Module], caller: str) -> list[nn.Module]:
    if isinstance(modules, nn.Module) and not isinstance(modules, nn.ModuleList):
        return [modules]
    items = list(modules)
    for item in items:
        if not isinstance(item, nn.Module):
            raise TypeError(
                f"{caller}: expected nn.Module stage modules, got {type(item).__name__}"
            )
    return items


def _names(modules: list[nn.Module]) -> list[list[str]]:
    """The state-dict keys of each module (params and persistent buffers), no collective."""
    return [list(module.state_dict(keep_vars=True)) for module in modules]


def check_stage_names(
    modules: nn.Module | Iterable[nn.Module],
    meshes: MoEMeshes,
    *,
    caller: str = "check_stage_names",
) -> None:
    """Refuse stage modules whose param or buffer names clash across pipeline stages.

    See Note [Stage names]. Nothing happens when ``meshes.pp == 1``.

    Args:
        modules: this rank's stage module, or a list of them (all of this rank's stages).
        meshes: this stage's :class:`~dtensor_moe.parallel.MoEMeshes`.

    Keyword Args:
        caller: the function named in the error message.

    Collectives: with ``meshes.pp > 1``, one ``all_gather_object`` over ``meshes.pp_mesh`` (every
    pp rank must call it, the same number of times); none otherwise.

    Raises:
        TypeError: ``meshes`` is not an :class:`MoEMeshes` or an entry is not a module (before
            any collective).
        ValueError: on every rank, after the gather, when two stage modules hold the same name.
    """
    meshes = require_meshes(meshes, caller)
    items = _as_modules(modules, caller)
    if meshes.pp == 1:
        return
    group = meshes.pp_mesh.get_group()
    mine = (dist.get_rank(), _names(items))
    gathered: list = [None] * meshes.pp
    dist.all_gather_object(gathered, mine, group=group)
    owners: dict[str, list[int]] = {}
    for rank, per_module in gathered:
        for names in per_module:
            for name in names:
                owners.setdefault(name, []).append(rank)
    clashes = sorted(name for name, ranks in owners.items() if len(ranks) > 1)
    if clashes:
        shown = ", ".join(f"{n} (ranks {owners[n]})" for n in clashes[:_SHOWN])
        more = f" and {len(clashes) - _SHOWN} more" if len(clashes) > _SHOWN else ""
        raise ValueError(
            f"{caller}: {len(clashes)} param/buffer names are held by more than one pipeline "
            f"stage module: {shown}{more}. A checkpoint would store these stages' tensors under "
            "the same keys and load one stage's weights into the other. Keep the full model's "
            "names in every stage module: hold the layers in an nn.ModuleDict keyed by their "
            "index in the full model and delete what other stages hold (del on an "
            "nn.ModuleList renumbers it); see docs/pipeline.md"
        )


def _resharding_fsdp_modules(module: nn.Module) -> list[str]:
    """The names of the ``fully_shard`` modules inside ``module`` that reshard after forward."""
    fsdp = [(name, m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    found = []
    for name, m in fsdp:
        root = not any(name.startswith(f"{other}.") or (other == "" and name)
                       for other, _ in fsdp if other != name)  # fmt: skip
        if _compat.fsdp_reshards_after_forward(m, root=root):
            found.append(name or "<stage root>")
    return found


def check_schedule(schedule: object) -> object:
    """Refuse a V-shaped schedule whose stages reshard FSDP2 params after forward; returns
    ``schedule``.

    See Note [FSDP2 under V schedules]. ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
    are checked; other schedules pass. No collective: every rank checks its own stages, and
    every rank of an SPMD program sharded its stages alike.

    Raises:
        ValueError: a stage module of a V schedule holds a ``fully_shard`` module that reshards
            its params after forward (``reshard_after_forward=True``).
    """
    # imported here: a process that never builds a schedule does not load torch's pipelining
    from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleZBVZeroBubble

    if not isinstance(schedule, (ScheduleZBVZeroBubble, ScheduleDualPipeV)):
        return schedule
    kind = type(schedule).__name__
    for stage in _compat.schedule_stages(schedule):
        names = _resharding_fsdp_modules(stage.submod)
        if names:
            raise ValueError(
                f"{kind}: stage {stage.stage_index}'s FSDP2 modules {names[:_SHOWN]} reshard "
                "their params after forward (reshard_after_forward=True), with which torch's "
                "V-shaped schedules leave some gradients None or wrong; pass "
                "reshard_after_forward=False to fully_shard_moe (its default when meshes.pp > "
                "1) or call module.set_reshard_after_forward(False) on the stage module"
            )
    return schedule
