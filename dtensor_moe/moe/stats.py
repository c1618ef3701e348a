"""Load telemetry: tokens per expert of every MoE router, reduced over ranks in one collective.

Shape legend:
    M  routers (MoE layers) in the module tree      E  routed experts

The figures come from each router's ``tokens_per_expert`` counter: the (token, expert) pairs
routed since the counter was last reset (by :func:`~dtensor_moe.moe.update_expert_bias`, or by
``load_stats(..., reset=True)``), counted in training mode only. Under every parallel layout each
token is counted on exactly one rank (Note [Global router statistics] in
``parallel/token_parallel.py``), so the sum over all ranks is the global count.
A router that keeps no ``tokens_per_expert`` counter (Note [Router protocol] in ``protocol.py``)
has no figures: its layer is left out.

Note [Load stats across pipeline stages]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under pipeline parallelism each rank holds one stage's layers, so no rank can sum another
stage's counters, and the stages hold different numbers of layers (possibly none, possibly with
different ``E``): a tensor collective would need a common size that no rank knows. So
``load_stats(stage_module, meshes=meshes)`` with ``meshes.pp > 1`` runs one
``all_gather_object`` over the default group, each rank sending its stage index, its layer
names and its flat int counters (routed, then dropped, as :func:`_counters` lays them out);
every rank then sums the counters of each stage over that stage's ranks (each token counted on
exactly one rank of the stage, Note [Counters under pipeline parallelism] in ``balance.py``)
and lists the layers by ``pp_rank``, then in the order each rank holds them (a rank that runs
several stages, under an interleaved or V-shaped schedule, passes its stage modules as a
sequence, so one call still runs one collective). torch runs ``all_gather_object`` as two
``all_gather`` calls, the payload sizes then the payloads. The names are the stage modules' own names, optionally
behind ``prefix``; they must be unique across the model, which holds when each stage module
keeps the full model's names (a full model copy with the other stages' layers deleted, layers in
an ``nn.ModuleDict`` keyed by their index). Every rank receives the same objects, so every rank
raises the same error on repeated names.
"""

# ruff: noqa: N806

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from dtensor_moe.moe.balance import check_group_in_stage
from dtensor_moe.moe.protocol import Router, StageMeshes, is_router, require_stage_meshes

__all__ = ["LayerLoad", "load_stats"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerLoad:
    """Tokens per expert of one router, summed over ranks.

    Attributes:
        name: the router's owner's name in ``model.named_modules()`` (the MoE layer; the
            router's own name when it has no MoE parent).
        counts: (token, expert) pairs routed to each expert.
        total: ``sum(counts)``: routed tokens times ``top_k``.
        min, max: fewest and most tokens an expert received.
        mean: ``total / E``.
        cv: coefficient of variation, ``std / mean`` with the population std (0: perfectly
            balanced); ``nan`` when no token was counted.
        dead: experts that received no token.
        dropped: (token, expert) pairs that the experts dropped for lack of capacity (part of
            ``total``; 0 without a capacity (``MoEConfig.capacity_factor`` or
            ``capacity_per_expert``): routing is dropless).
        dropped_per_expert: ``dropped`` per expert (all 0 without a capacity).
    """

    name: str
    counts: tuple[int, ...]
    total: int
    min: int
    max: int
    mean: float
    cv: float
    dead: tuple[int, ...]
    dropped: int = 0
    dropped_per_expert: tuple[int, ...] = ()

    @classmethod
    def from_counts(cls, name: str, counts: list[int], dropped: list[int] | None = None) -> LayerLoad:
        """The figures of one counter (plain ints: exact); ``dropped``: the dropped pairs per
        expert (none when ``None``)."""
        dropped = [0] * len(counts) if dropped is None else dropped
        E, total = len(counts), sum(counts)
        mean = total / E
        if total == 0:
            cv = math.nan
        else:
            cv = math.sqrt(sum((c - mean) ** 2 for c in counts) / E) / mean
        return cls(
            name=name,
            counts=tuple(counts),
            total=total,
            min=min(counts),
            max=max(counts),
            mean=mean,
            cv=cv,
            dead=tuple(e for e, c in enumerate(counts) if c == 0),
            dropped=sum(dropped),
            dropped_per_expert=tuple(dropped),
        )

    def line(self) -> str:
        """One compact line: ``name: tokens/expert min .. max, mean .., cv .., dead .., ...``."""
        return (
            f"{self.name}: tokens/expert min {self.min} max {self.max} mean {self.mean:.1f} "
            f"cv {self.cv:.2f}; dead experts {len(self.dead)}/{len(self.counts)}; "
            f"dropped {self.dropped}"
        )


def _named_routers(
    model: nn.Module | Sequence[nn.Module], prefix: str = ""
) -> list[tuple[str, Router]]:
    """``(prefix + owner name, router)`` of every router of ``model`` that keeps counters (of
    each module in turn when it is a sequence of modules: the stages a rank runs under an
    interleaved schedule)."""
    return [(name, r) for name, r in _all_named_routers(model, prefix) if _counts(r)]


def _all_named_routers(
    model: nn.Module | Sequence[nn.Module], prefix: str
) -> list[tuple[str, Router]]:
    models = [model] if isinstance(model, nn.Module) else list(model)
    named = []
    for part in models:
        for name, module in part.named_modules():
            if is_router(module):
                owner, _, child = name.rpartition(".")
                named.append((prefix + (owner if child == "router" else name), module))
    return named


def _counts(router: Router) -> bool:
    return router.tokens_per_expert is not None


def _no_router(model: nn.Module | Sequence[nn.Module], where: str, fix: str) -> ValueError:
    """The error of a model without a counting router, naming the routers that count nothing."""
    silent = [f"{type(r).__name__} at {name or '<root>'!r}"
              for name, r in _all_named_routers(model, "") if not _counts(r)]
    if silent:
        return ValueError(
            f"load_stats found no router with a tokens_per_expert counter in {where}; its "
            f"routers keep none ({', '.join(silent[:3])}{' ...' if len(silent) > 3 else ''}), "
            "so there are no figures to report"
        )
    return ValueError(f"load_stats found no MoE router in {where}; {fix}")


def _group(process_group: object) -> dist.ProcessGroup | None:
    """The group ``load_stats`` reduces over (``None``: no collective)."""
    if process_group == "world" and isinstance(process_group, str):
        initialized = dist.is_available() and dist.is_initialized()
        return dist.group.WORLD if initialized else None
    if isinstance(process_group, str) or process_group is None:
        if process_group == "local":
            return None
        raise ValueError(
            f"load_stats: process_group={process_group!r} is not 'world', 'local' or a "
            "ProcessGroup; pass 'local' for this process's counters alone"
        )
    return process_group


def load_stats(
    model: nn.Module | Sequence[nn.Module],
    *,
    process_group: dist.ProcessGroup | Literal["world", "local"] = "world",
    reset: bool = False,
    meshes: StageMeshes | None = None,
    prefix: str = "",
) -> list[LayerLoad]:
    """Tokens-per-expert figures of every MoE layer in ``model``, in module order (the layers
    whose router keeps a ``tokens_per_expert`` counter: Note [Router protocol] in
    ``protocol.py``).

    ``model`` is a module, or a sequence of modules taken in turn (the stage modules of one
    rank under an interleaved or V-shaped pipeline schedule).

    Keyword Args:
        process_group: the ranks whose counters are summed. ``"world"`` (default): every
            rank (``dist.group.WORLD``) when ``torch.distributed`` is initialized, which is the
            global count under every parallel layout of this package, and this process
            alone otherwise; ``"local"``: this process's counters, no collective; or a group.
        reset: zero the counters afterwards (what :func:`~dtensor_moe.moe.update_expert_bias`
            also does). Leave it ``False`` when the expert bias is updated from them.
        meshes: the :class:`~dtensor_moe.MoEMeshes` of this rank. With
            ``meshes.pp > 1``, ``model`` is this rank's pipeline stage module (or modules) and
            the result lists every MoE layer of every stage, the same on every rank, ordered by
            ``pp_rank`` and then as each rank lists them (Note [Load stats across pipeline
            stages]); a stage may hold no MoE layer. With ``pp == 1`` the call is the one
            without ``meshes``. Leave ``process_group`` at ``"world"`` with it.
        prefix: put in front of every layer name (for a stage module that is a submodule of
            the model, e.g. ``"layers."``).

    Collectives: one ``all_reduce`` of the ``2 * M * E`` int64 counts (routed and dropped,
    every layer at once) when a group applies; with ``meshes.pp > 1`` one
    ``all_gather_object`` over every rank instead. Nothing runs during the forward. Call it on
    every rank of the group (of the world with ``meshes``).

    Raises:
        ValueError: when no router with counters is found (in ``model``, or in any stage
            with ``meshes``; the message names the routers that keep none),
            ``process_group`` is another string or is given with ``meshes``, the group
            (``"world"`` included) holds a rank outside the pipeline stage that
            ``parallelize_moe`` recorded on a router (Note [A router knows its stage] in
            ``balance.py``; locally, before any collective), or two stages name a layer alike.
    """
    group = _group(process_group)
    if meshes is not None:
        _check_meshes(meshes, process_group)
        if meshes.pp > 1:
            return _load_stats_across_stages(model, meshes, reset=reset, prefix=prefix)
    named = _named_routers(model, prefix)
    if not named:
        raise _no_router(model, _describe(model), "pass the model that holds the MoE layers")
    fix = (
        "Pass meshes=meshes (each layer's counters are then summed over its stage), or "
        "process_group='local'"
    )
    check_group_in_stage([r for _, r in named], group, "load_stats", fix)
    # every layer's counters (routed, then dropped) in one flat int64 tensor (layers may
    # differ in E): one collective
    counts_N = torch.cat([_counters(r) for _, r in named]).clone()
    if group is not None:
        dist.all_reduce(counts_N, group=group)
    if reset:
        for _, router in named:
            router.reset_counters()
    flat, sizes = counts_N.tolist(), [r.tokens_per_expert.numel() for _, r in named]
    starts = [2 * sum(sizes[:i]) for i in range(len(sizes))]
    return [
        LayerLoad.from_counts(name, flat[start : start + size],
                              flat[start + size : start + 2 * size])
        for (name, _), start, size in zip(named, starts, sizes, strict=True)
    ]


def _describe(model: nn.Module | Sequence[nn.Module]) -> str:
    if isinstance(model, nn.Module):
        return type(model).__name__
    return "[" + ", ".join(type(m).__name__ for m in model) + "]"


def _check_meshes(meshes: object, process_group: object) -> None:
    require_stage_meshes(meshes, "load_stats")
    if not (isinstance(process_group, str) and process_group == "world"):
        raise ValueError(
            f"load_stats: pass either meshes or process_group, got process_group="
            f"{process_group!r} with meshes; with meshes the counters of each layer are summed "
            "over the ranks of its pipeline stage"
        )


def _load_stats_across_stages(
    model: nn.Module | Sequence[nn.Module], meshes: StageMeshes, *, reset: bool, prefix: str
) -> list[LayerLoad]:
    """Note [Load stats across pipeline stages]: one ``all_gather_object`` over the world."""
    named = _named_routers(model, prefix)
    sizes = [r.tokens_per_expert.numel() for _, r in named]
    flat = torch.cat([_counters(r) for _, r in named]).tolist() if named else []
    mine = (meshes.pp_rank, [name for name, _ in named], sizes, flat)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if reset:
        for _, router in named:
            router.reset_counters()
    stages: dict[int, tuple[list[str], list[int], list[int]]] = {}
    for pp_rank, names, layer_sizes, counts in gathered:
        if pp_rank not in stages:
            stages[pp_rank] = (names, layer_sizes, list(counts))
        else:  # another rank of the same stage: same layers, its own tokens
            total = stages[pp_rank][2]
            total[:] = [a + b for a, b in zip(total, counts, strict=True)]
    loads, seen = [], set()
    for pp_rank in sorted(stages):
        names, layer_sizes, counts = stages[pp_rank]
        start = 0
        for name, size in zip(names, layer_sizes, strict=True):
            if name in seen:
                raise ValueError(
                    f"load_stats: two pipeline stages hold a layer named {name!r} (stage "
                    f"{pp_rank} and an earlier one); give each stage module the full model's "
                    "names (layers in an nn.ModuleDict keyed by their index) or pass prefix="
                )
            seen.add(name)
            routed, dropped = counts[start : start + size], counts[start + size : start + 2 * size]
            loads.append(LayerLoad.from_counts(name, routed, dropped))
            start += 2 * size
    if not loads:
        where = f"any pipeline stage ({_describe(model)} on this rank)"
        raise _no_router(model, where, "pass each stage's module")
    return loads


def _counters(router: Router) -> torch.Tensor:
    """``tokens_per_expert`` then ``dropped_per_expert`` (zeros without a capacity), flat."""
    routed = router.tokens_per_expert.detach().reshape(-1)
    dropped = router.dropped_per_expert
    return torch.cat((routed, torch.zeros_like(routed) if dropped is None else dropped))
