"""Pipeline stages the safe way: :func:`split_stage`, :func:`build_stage`, :func:`check_batch`.

What every user of ``torch.distributed.pipelining`` with MoE layers writes the same way, and where
small slips train silently wrong (docs/pipeline.md):

* :func:`split_stage` keeps one stage's part of a model built whole on every rank, with the full
  model's names (``layers.3`` stays ``layers.3``, which DCP checkpoints, ``load_stats`` and the
  parity checks rely on);
* :func:`build_stage` builds torch's ``PipelineStage`` with static metadata, so torch never runs
  its shape-inference forward (in which the routers would route and count uninitialised
  buffers), with ``requires_grad`` where a gradient crosses the stages, on ``meshes.pp_mesh``;
* :func:`check_batch` checks, on every rank and before the schedule runs anything, that a step's
  batch splits into the schedule's micro-batches of the size the stages were built for (a wrong
  split otherwise ends in a collective mismatch or a hang).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dtensor_moe import _compat
from dtensor_moe.parallel.mesh import MoEMeshes, require_meshes
from dtensor_moe.parallel.stages import check_schedule, check_stage_names

__all__ = ["build_stage", "check_batch", "split_stage"]


def _layer_split(num_layers: int, num_stages: int, layers_per_stage: Sequence[int] | None) -> list:
    if layers_per_stage is None:
        if num_layers % num_stages:
            raise ValueError(
                f"split_stage: {num_layers} layers do not split evenly into {num_stages} stages; "
                "pass layers_per_stage=[...] (one count per stage, summing to the layers)"
            )
        return [num_layers // num_stages] * num_stages
    counts = [int(c) for c in layers_per_stage]
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 0:
        raise ValueError(
            f"split_stage: layers_per_stage={list(layers_per_stage)} must hold {num_stages} "
            f"counts >= 0 (one per stage) summing to the model's {num_layers} layers"
        )
    return counts


def split_stage(
    model: nn.Module,
    stage_index: int,
    num_stages: int,
    *,
    layers: str = "layers",
    first: Sequence[str] = (),
    last: Sequence[str] = (),
    layers_per_stage: Sequence[int] | None = None,
) -> nn.Module:
    """Keep stage ``stage_index``'s part of ``model`` (in place) and return it.

    Build the whole model on every rank with the same weights, then call this: the layers of
    other stages are deleted from ``model.<layers>``, an ``nn.ModuleDict`` keyed by the layer
    index (so every param keeps the full model's name), and the modules named in ``first``
    (``last``) become ``None`` on every stage but the first (last): the forward skips ``None``
    modules. Stage ``s`` keeps the ``layers_per_stage[s]`` layers after those of the stages
    before it (an even split by default). No collective.

    Raises:
        TypeError: ``model.<layers>`` is not an ``nn.ModuleDict`` (an ``nn.ModuleList`` renumbers
            its entries on deletion, so two stages would hold the same names).
        ValueError: a stage index out of range, a split that does not cover the layers, or a
            name in ``first``/``last`` that ``model`` has no module for.
    """
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"split_stage: stage_index {stage_index} not in [0, {num_stages})")
    container = getattr(model, layers, None)
    if not isinstance(container, nn.ModuleDict):
        raise TypeError(
            f"split_stage: model.{layers} must be an nn.ModuleDict keyed by the layer index, got "
            f"{type(container).__name__}; deleting from an nn.ModuleList renumbers it, so every "
            f"stage would hold {layers}.0, {layers}.1, ... Build it as "
            f"nn.ModuleDict({{str(i): layer for i, layer in enumerate(...)}})"
        )
    missing = [n for n in (*first, *last) if not isinstance(getattr(model, n, None), nn.Module)]
    if missing:
        raise ValueError(f"split_stage: model has no module named {missing}")
    counts = _layer_split(len(container), num_stages, layers_per_stage)
    start = sum(counts[:stage_index])
    keep = set(list(container)[start : start + counts[stage_index]])
    for name in list(container):
        if name not in keep:
            del container[name]
    for name in first if stage_index != 0 else ():
        setattr(model, name, None)
    for name in last if stage_index != num_stages - 1 else ():
        setattr(model, name, None)
    return model


def _example(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A ``meta`` copy of ``t``'s metadata; floating ones take a gradient where one crosses."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"build_stage: example args must be tensors, got {type(t).__name__}")
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return out.requires_grad_(requires_grad and t.is_floating_point())


def _examples(args: object, requires_grad: bool) -> tuple[torch.Tensor, ...]:
    args = args if isinstance(args, (tuple, list)) else (args,)
    return tuple(_example(t, requires_grad) for t in args)


def build_stage(
    module: nn.Module,
    meshes: MoEMeshes,
    *,
    stage_index: int,
    num_stages: int,
    input_args: torch.Tensor | Sequence[torch.Tensor],
    output_args: torch.Tensor | Sequence[torch.Tensor],
    device: torch.device | None = None,
) -> object:
    """torch's ``PipelineStage`` for ``module`` with static metadata, on ``meshes.pp_mesh``.

    ``input_args``/``output_args``: example tensors (any device; only their shape, stride and
    dtype are used) of ONE micro-batch of one pipeline: the tokens on the first stage, else the
    activation received; the activation sent, or the logits on the last stage. Floating ones
    get ``requires_grad=True`` (a gradient crosses the stages), so neither torch's "grad can be
    implicitly created only for scalar outputs" nor its shape-inference forward can happen:
    with static metadata torch runs no extra forward, in which the MoE layers would route, and
    their routers count, uninitialised buffers. Plain tensors only (for DTensor activations,
    build the ``PipelineStage`` as docs/pipeline.md shows).

    Keyword Args:
        device: the stage's device; default: the CPU for a ``"cpu"`` mesh, else the current
            device of the meshes' type.

    Returns:
        a ``torch.distributed.pipelining.PipelineStage``. Collectives: one
        ``all_gather_object`` over ``meshes.pp_mesh`` that compares the stages' param and buffer
        names (:func:`~dtensor_moe.parallel.check_stage_names`), so call it on every rank, once
        per stage.

    Raises:
        ValueError: ``meshes.pp == 1``, a stage index or count that does not fit the meshes, or
            (on every rank) a name that two stage modules hold.
    """
    from torch.distributed.pipelining import PipelineStage

    meshes = require_meshes(meshes, "build_stage")
    if meshes.pp == 1 or meshes.pp_mesh is None:
        raise ValueError("build_stage needs the meshes of build_moe_meshes(pp=...) with pp > 1")
    if num_stages % meshes.pp or not 0 <= stage_index < num_stages:
        raise ValueError(
            f"build_stage: stage_index={stage_index} of num_stages={num_stages} does not fit "
            f"pp={meshes.pp} (num_stages must be a multiple of pp, the index in [0, num_stages))"
        )
    if device is None:
        kind = meshes.dense.device_type
        device = torch.device(kind) if kind == "cpu" else torch.device(
            kind, torch.get_device_module(kind).current_device()
        )
    check_stage_names(module, meshes, caller="build_stage")  # Note [Stage names]
    return PipelineStage(
        module,
        stage_index,
        num_stages,
        device,
        input_args=_examples(input_args, requires_grad=stage_index > 0),
        output_args=_examples(output_args, requires_grad=True),
        group=meshes.pp_mesh.get_group(),
    )


def check_batch(
    schedule: object, *, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None
) -> None:
    """Check a step's batch against ``schedule`` on every rank, before ``schedule.step``.

    Call it on every rank of the job, with the step's ``inputs`` where this rank runs the first
    stage and its ``target`` where it runs the last (``None`` elsewhere): the rows of each (dim
    0) must be the schedule's number of micro-batches times the micro-batch rows of the stages'
    static metadata (what :func:`build_stage` was given), or at least a multiple of the number
    of micro-batches. Every rank learns every rank's figures and raises the same ``ValueError``,
    so no rank goes on into the schedule's sends and collectives while another stops.

    It also runs :func:`~dtensor_moe.parallel.check_schedule` (a V-shaped schedule over FSDP2
    modules that reshard after forward raises; no collective).

    Collectives: one ``all_gather`` of 4 integers per rank over the default group.
    """
    check_schedule(schedule)
    stages = _compat.schedule_stages(schedule)
    n_micro = _compat.schedule_microbatches(schedule)
    rows = [_compat.stage_microbatch_rows(stage) for stage in stages]
    known = [r for r in rows if r is not None]
    mine = torch.tensor(
        [
            -1 if inputs is None else inputs.shape[0],
            -1 if target is None else target.shape[0],
            known[0] if known else -1,
            n_micro,
        ],
        dtype=torch.int64,
    )
    world = dist.get_world_size()
    if "gloo" not in str(dist.get_backend()):  # a backend of device tensors only (nccl)
        mine = mine.to(torch.accelerator.current_accelerator())
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine)
    problem = _first_problem(torch.stack(table).cpu().tolist())
    if problem:
        raise ValueError(f"check_batch: {problem}")


def _first_problem(table: list[list[int]]) -> str | None:
    """The first rank's batch that does not split, in words; the same on every rank."""
    for rank, (inputs, target, mb, n_micro) in enumerate(table):
        for what, got in (("inputs", inputs), ("target", target)):
            if got < 0:
                continue
            if mb > 0 and got != n_micro * mb:
                return (
                    f"rank {rank}'s {what} have {got} rows, but its schedule runs {n_micro} "
                    f"micro-batches of {mb} rows (the stages' example args): give each pipeline "
                    f"{n_micro * mb} rows per step, or build the stages with "
                    f"{got // n_micro if got % n_micro == 0 else '<rows / micro-batches>'} rows "
                    "per micro-batch"
                )
            if got % n_micro:
                return (
                    f"rank {rank}'s {what} have {got} rows, which do not split into {n_micro} "
                    "equal micro-batches: choose a batch that the number of micro-batches divides"
                )
    return None
