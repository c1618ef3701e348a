"""The two device meshes of an MoE model: the dense mesh and the expert mesh.

Note [MoE meshes]
~~~~~~~~~~~~~~~~~
An MoE model puts its parameters on two meshes over the same ``world = dp * tp`` ranks:

- ``dense`` (2-D, ``("dp", "tp")``): attention and other dense layers. ``"tp"`` runs tensor /
  sequence parallelism, ``"dp"`` data parallelism (FSDP of the dense params).
  ``rank = dp_i * tp + tp_i``.
- ``expert`` (3-D, ``("edp", "ep", "etp")``): the routed experts. ``"ep"`` shards the experts
  (``Shard(0)``), ``"etp"`` shards each expert's hidden dim (expert tensor parallelism) and
  ``"edp"`` is what is left for data parallelism of the expert params (FSDP on ``"edp"``).
  ``rank = (edp_i * ep + ep_i) * etp + etp_i``, ``etp = tp`` with ``expert_tp`` else ``1``,
  ``edp = world // (ep * etp)``.

Both meshes list the ranks in row-major order, so ``init_device_mesh`` builds them. The
consequences that the parallel styles rely on:

- ``expert_tp=True`` (EP x TP): the ``"etp"`` groups *are* the dense ``"tp"`` groups, and each
  ``"ep"`` group takes the ranks with the same ``tp_i`` from ``ep`` consecutive ``dp`` groups;
  so ``ep`` must divide ``dp``.
- ``expert_tp=False`` and ``tp > 1`` ("EP borrows TP"): each ``"ep"`` group is ``ep``
  consecutive ranks, which hold whole ``"tp"`` groups because ``ep`` is a multiple of ``tp``;
  ``ep`` must divide ``world``. The tokens a tp group holds are routed by the tp ranks
  themselves (each a sequence shard under SP, or a ``1/tp`` slice of a replicated input).
- ``tp == 1``: ``ep`` divides ``dp`` and ``"ep"`` runs over data-parallel ranks ("dp2ep").

With pipeline parallelism (``pp > 1``) the world holds ``pp`` stages of ``dp * tp`` ranks
each, ``pp`` outermost: ``rank = pp_i * (dp * tp) + r`` where ``r`` is the rank inside the
stage laid out as above. Each stage gets its own ``dense`` and ``expert`` meshes over its own
ranks (slices of a ``("pp", "dp", "tp")`` and a ``("pp", "edp", "ep", "etp")`` mesh), so every
helper that takes the meshes works unchanged inside a stage and never reaches another stage.
Beside them: ``pp_mesh``, the 1-D ``"pp"`` mesh over the ranks holding the same position in
every stage (the ranks that exchange activations), and ``stage_group``, the process group of
this stage's ``dp * tp`` ranks: the ranks that hold the same layers, over which the counters of
those layers are summed (Note [Counters under pipeline parallelism] in
``dtensor_moe/moe/balance.py``). Nothing assumes a stage holds MoE layers. ``pp = 1`` gives the
meshes of one stage over the whole world, built exactly as without ``pp``, with
``pp_mesh=None`` and ``stage_group`` the default group.

Everything is validated before any mesh (any process group) is created, from arguments that
are the same on every rank, so every rank raises the same error and none hangs.

Note [One mesh per layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``build_moe_meshes`` returns the *same* meshes when it is called again with the same
arguments under the same default process group, as long as they are alive (Note [Mesh
memo]). Two calls to ``init_device_mesh`` with the same shape give meshes that compare
equal but own different process groups, and torch 2.13's sharding-propagation cache compares
meshes by value: a cached output spec can carry the first mesh, so one rank may run a
collective on the first mesh's group while its peer runs it on the second's, and both wait
forever (observed with the tp all-gather of ``full_tensor()`` after an equal mesh had been
used). Reusing the meshes also avoids creating process groups again. Build other meshes of the
same shape from these (slice them) rather than with ``init_device_mesh``.

Note [Mesh memo]
~~~~~~~~~~~~~~~~
What ``build_moe_meshes`` remembers for Note [One mesh per layout] holds weak references only:

- key: ``(pp, dp, ep, tp, expert_tp, device_type)``;
- value: weak references to the default process group it was built under and to the meshes
  (with ``pp > 1``: the two root meshes with a leading ``"pp"`` dim, the stage slices handed
  out, and the stage group). A slice holds its root, and slicing a live root again creates no
  process group and gives a mesh with the same groups, so a stage mesh is reused while it or
  any slice of its root is alive;
- bound: one entry per argument tuple; dead entries are dropped at the next call;
- lifetime: the meshes live as long as something else holds them (their DTensors and modules,
  torch's sharding-propagation and redistribute caches, the caller's :class:`MoEMeshes`). The
  memo keeps no mesh and no process group alive, so ``destroy_process_group`` and ``del``
  release them. ``dtensor_moe.clear_caches()`` leaves the memo alone: it holds nothing, and
  dropping it could build a second mesh equal to one still in use.

A mesh is reused under the same default group while it is alive and rebuilt once it is dead
(the :class:`MoEMeshes` around the two is a new, equal object). The hang of Note [One mesh per
layout] needs the old mesh alive (in a cache or a DTensor), and then it is reused. Reusing or
rebuilding decides whether process groups are created (``new_group`` on every rank), so every
rank must decide alike: when an entry exists, ``gc.collect()`` runs first, so "alive" means
"reachable" (the same on every rank of an SPMD program), not "not collected yet".
"""

from __future__ import annotations

import gc
import os
import weakref
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MoEMeshes", "build_moe_meshes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEMeshes:
    """The dense and expert meshes of one MoE model (of this pipeline stage with ``pp > 1``);
    see Note [MoE meshes].

    Attributes:
        dp: data-parallel degree of the dense params (``world // (pp * tp)``).
        ep: expert-parallel degree.
        tp: tensor/sequence-parallel degree of the dense layers.
        expert_tp: ``True``: experts are also sharded on the tp ranks (EP x TP, ``etp = tp``);
            ``False``: EP borrows the tp ranks (``etp = 1``).
        dense: 2-D mesh ``("dp", "tp")``, ``rank = dp_i * tp + tp_i``.
        expert: 3-D mesh ``("edp", "ep", "etp")``, ``rank = (edp_i * ep + ep_i) * etp + etp_i``.
        pp: number of pipeline stages (``1``: no pipeline parallelism).
        pp_rank: this process's stage, ``rank // (dp * tp)``.
        pp_mesh: 1-D mesh ``("pp",)`` over the ranks holding this rank's position in every
            stage (``None`` when ``pp == 1``).
        stage_ranks: the global ranks of this stage, ascending (every rank when ``pp == 1``).
        stage_group: the process group of ``stage_ranks`` (the default group when ``pp == 1``).

    ``dense`` and ``expert`` span this stage's ranks only; with ``pp > 1`` the ranks are offset
    by ``pp_rank * dp * tp`` from the formulas above.
    """

    dp: int
    ep: int
    tp: int
    expert_tp: bool
    dense: DeviceMesh
    expert: DeviceMesh
    pp: int = 1
    pp_rank: int = 0
    pp_mesh: DeviceMesh | None = None
    stage_ranks: tuple[int, ...] = ()
    stage_group: dist.ProcessGroup | None = None

    @property
    def etp(self) -> int:
        """Expert tensor-parallel degree: ``tp`` with ``expert_tp``, else 1."""
        return self.tp if self.expert_tp else 1

    @property
    def edp(self) -> int:
        """Data-parallel degree of the expert params: ``dp * tp // (ep * etp)``."""
        return self.dp * self.tp // (self.ep * self.etp)


@dataclass(frozen=True, slots=True)
class _Built:
    """One entry of the memo of Note [Mesh memo]: weak references only.

    ``dense``/``expert`` are the meshes handed out (stage slices with ``pp > 1``);
    ``dense_root``/``expert_root`` their roots with the leading ``"pp"`` dim and
    ``stage_group`` the group of the stage's ranks (``pp > 1`` only, else ``None``).
    """

    world: weakref.ref
    dense: weakref.ref
    expert: weakref.ref
    dense_root: weakref.ref | None = None
    expert_root: weakref.ref | None = None
    stage_group: weakref.ref | None = None

    def alive(self) -> bool:
        refs = (self.dense, self.expert, self.dense_root, self.expert_root)
        return any(ref is not None and ref() is not None for ref in refs)


def require_meshes(meshes: object, caller: str) -> MoEMeshes:
    """``meshes`` if it is an :class:`MoEMeshes`, else ``TypeError`` naming ``caller``."""
    if not isinstance(meshes, MoEMeshes):
        raise TypeError(
            f"{caller}: meshes must be the MoEMeshes of build_moe_meshes, got "
            f"{type(meshes).__name__}"
        )
    return meshes


# (pp, dp, ep, tp, expert_tp, device_type) -> _Built; see Note [Mesh memo]
_BUILT: dict[tuple, _Built] = {}


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    raise ValueError(
        "build_moe_meshes needs the world size: initialise torch.distributed "
        "(dist.init_process_group) or launch with torchrun (sets WORLD_SIZE)"
    )


def _check_pp(pp: int, world: int) -> int:
    """The ranks per stage, ``world // pp``; ``ValueError`` naming the values otherwise."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"build_moe_meshes: pp must be an int >= 1, got pp={pp!r}")
    if world % pp != 0:
        raise ValueError(
            f"build_moe_meshes: pp must divide the world size, got pp={pp} for world size "
            f"{world}; pick pp among the divisors of {world}"
        )
    return world // pp


def _check_degrees(dp: int, ep: int, tp: int, expert_tp: bool, world: int, pp: int = 1) -> None:
    """Raise ``ValueError``/``TypeError`` naming the values and the fix; see Note [MoE meshes].

    ``world`` is the number of ranks of one stage (the world size when ``pp == 1``).
    """
    for name, value in (("dp", dp), ("ep", ep), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"build_moe_meshes: {name} must be an int >= 1, got {name}={value!r}")
    if not isinstance(expert_tp, bool):
        raise TypeError(f"build_moe_meshes: expert_tp must be a bool, got {expert_tp!r}")
    if dp * tp != world:
        if pp == 1:
            raise ValueError(
                f"build_moe_meshes: dp * tp must equal the world size, got dp={dp}, tp={tp} "
                f"(dp * tp = {dp * tp}) for world size {world}; choose dp = {world} // tp"
            )
        raise ValueError(
            f"build_moe_meshes: pp * dp * tp must equal the world size, got pp={pp}, dp={dp}, "
            f"tp={tp} (pp * dp * tp = {pp * dp * tp}) for world size {pp * world}; choose "
            f"dp = {world} // tp"
        )
    if expert_tp or tp == 1:
        if dp % ep != 0:
            where = "EP x TP (expert_tp=True)" if tp > 1 else "tp=1"
            raise ValueError(
                f"build_moe_meshes: with {where} the ep groups run over the dp ranks, so ep must "
                f"divide dp; got ep={ep}, dp={dp}; pick ep among the divisors of {dp}"
            )
        return
    if ep % tp != 0 or world % ep != 0:
        stage = "the world size" if pp == 1 else "the ranks of a stage (dp * tp)"
        raise ValueError(
            f"build_moe_meshes: when EP borrows the tp ranks (expert_tp=False, tp={tp}), ep must "
            f"be a multiple of tp and divide {stage}; got ep={ep}, tp={tp}, "
            f"world={world}; use ep in {_borrowing_eps(tp, world)} or expert_tp=True"
        )


def _borrowing_eps(tp: int, world: int) -> list[int]:
    return [ep for ep in range(tp, world + 1, tp) if world % ep == 0]


def build_moe_meshes(
    *,
    dp: int,
    ep: int,
    tp: int = 1,
    expert_tp: bool = False,
    pp: int = 1,
    device_type: str = "cpu",
) -> MoEMeshes:
    """Build the dense ``("dp", "tp")`` and expert ``("edp", "ep", "etp")`` meshes (of this
    pipeline stage when ``pp > 1``).

    Keyword Args:
        dp: data-parallel degree of the dense params; ``pp * dp * tp`` must be the world size.
        ep: expert-parallel degree (``1``: experts not sharded on an ep dim).
        tp: tensor/sequence-parallel degree of the dense layers.
        expert_tp: shard each expert on the tp ranks too (EP x TP, ``ep`` divides ``dp``);
            ``False``: EP borrows the tp ranks (``ep`` a multiple of ``tp`` dividing ``dp * tp``).
        pp: number of pipeline stages, the outermost dim: stage ``s`` holds the ranks
            ``s * dp * tp`` to ``(s + 1) * dp * tp - 1``. ``1``: no pipeline parallelism.
        device_type: passed to ``init_device_mesh``.

    Returns:
        :class:`MoEMeshes` of this rank's stage. Creating the meshes creates their process
        groups (``new_group`` calls on every rank; with ``pp > 1`` also the groups of the
        ``"pp"`` dims and one group per stage); nothing else communicates. A second call with
        the same arguments under the same default group returns the same meshes while they are
        alive (Note [One mesh per layout]); the memo holds them weakly (Note [Mesh memo]).

    Raises:
        ValueError: before any process group is created, when the degrees do not fit the world
            size or each other (see Note [MoE meshes]).

    Example::

        meshes = build_moe_meshes(dp=2, ep=2, tp=2, expert_tp=True)   # 4 ranks, EP2 x TP2
        meshes.expert["ep"], meshes.expert["etp"], meshes.dense["tp"]
        stage = build_moe_meshes(pp=2, dp=2, ep=2)   # 8 ranks: two stages of dp2 x ep2
        stage.pp_rank, stage.pp_mesh, stage.stage_group
    """
    world = _world_size()
    stage_size = _check_pp(pp, world)
    _check_degrees(dp, ep, tp, expert_tp, stage_size, pp)
    key = (pp, dp, ep, tp, expert_tp, device_type)
    built = _live_entry(key)  # Note [One mesh per layout], Note [Mesh memo]
    etp = tp if expert_tp else 1
    expert_shape = (stage_size // (ep * etp), ep, etp)
    if pp == 1:
        dense = None if built is None else built.dense()
        expert = None if built is None else built.expert()
        if dense is None:
            dense = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
        if expert is None:
            expert = init_device_mesh(
                device_type, expert_shape, mesh_dim_names=("edp", "ep", "etp")
            )
        meshes = MoEMeshes(
            dp=dp, ep=ep, tp=tp, expert_tp=expert_tp, dense=dense, expert=expert,
            stage_ranks=tuple(range(world)), stage_group=dist.group.WORLD,
        )
        _BUILT[key] = _Built(*(weakref.ref(x) for x in (dist.group.WORLD, dense, expert)))
        return meshes
    return _build_stage_meshes(key, built, expert_shape, world)


def _build_stage_meshes(
    key: tuple, built: _Built | None, expert_shape: tuple[int, int, int], world: int
) -> MoEMeshes:
    """``build_moe_meshes`` with ``pp > 1``: slices of two meshes with a leading ``"pp"`` dim."""
    pp, dp, ep, tp, expert_tp, device_type = key
    dense_root = _deref(None if built is None else built.dense_root)
    expert_root = _deref(None if built is None else built.expert_root)
    stage_group = _deref(None if built is None else built.stage_group)
    if dense_root is None:
        dense_root = init_device_mesh(
            device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp")
        )
    if expert_root is None:
        expert_root = init_device_mesh(
            device_type, (pp, *expert_shape), mesh_dim_names=("pp", "edp", "ep", "etp")
        )
    stage_size = world // pp
    stages = [list(range(s * stage_size, (s + 1) * stage_size)) for s in range(pp)]
    if stage_group is None:
        # every rank creates every stage's group (new_group is collective over the world)
        stage_group, _ = dist.new_subgroups_by_enumeration(stages)
    dense = _deref(None if built is None else built.dense)
    expert = _deref(None if built is None else built.expert)
    if dense is None:
        dense = dense_root["dp", "tp"]  # slicing creates no process group
    if expert is None:
        expert = expert_root["edp", "ep", "etp"]
    pp_rank = dist.get_rank() // stage_size
    meshes = MoEMeshes(
        dp=dp, ep=ep, tp=tp, expert_tp=expert_tp, dense=dense, expert=expert,
        pp=pp, pp_rank=pp_rank, pp_mesh=dense_root["pp"], stage_ranks=tuple(stages[pp_rank]),
        stage_group=stage_group,
    )
    refs = (dist.group.WORLD, dense, expert, dense_root, expert_root, stage_group)
    _BUILT[key] = _Built(*(weakref.ref(x) for x in refs))
    return meshes


def _deref(ref: weakref.ref | None) -> object | None:
    return None if ref is None else ref()


def _live_entry(key: tuple) -> _Built | None:
    """The memo entry for ``key`` if it was built under the current default group (dropping
    dead entries), after a ``gc.collect()`` that makes liveness agree across ranks."""
    if key in _BUILT:
        gc.collect()  # Note [Mesh memo]: "alive" must mean "reachable" on every rank
    current = dist.group.WORLD if dist.is_initialized() else None
    for k, built in list(_BUILT.items()):
        if built.world() is not current or current is None or not built.alive():
            _BUILT.pop(k, None)  # ranks run as threads of one process may drop it together
    return _BUILT.get(key)
