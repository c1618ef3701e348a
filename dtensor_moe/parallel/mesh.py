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

- key: ``(dp, ep, tp, expert_tp, device_type)``;
- value: weak references to the default process group it was built under and to the two
  meshes;
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
    """The dense and expert meshes of one MoE model; see Note [MoE meshes].

    Attributes:
        dp: data-parallel degree of the dense params (``world // tp``).
        ep: expert-parallel degree.
        tp: tensor/sequence-parallel degree of the dense layers.
        expert_tp: ``True``: experts are also sharded on the tp ranks (EP x TP, ``etp = tp``);
            ``False``: EP borrows the tp ranks (``etp = 1``).
        dense: 2-D mesh ``("dp", "tp")``, ``rank = dp_i * tp + tp_i``.
        expert: 3-D mesh ``("edp", "ep", "etp")``, ``rank = (edp_i * ep + ep_i) * etp + etp_i``.
    """

    dp: int
    ep: int
    tp: int
    expert_tp: bool
    dense: DeviceMesh
    expert: DeviceMesh

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
    """One entry of the memo of Note [Mesh memo]: weak references only."""

    world: weakref.ref
    dense: weakref.ref
    expert: weakref.ref


# (dp, ep, tp, expert_tp, device_type) -> _Built; see Note [Mesh memo]
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


def _check_degrees(dp: int, ep: int, tp: int, expert_tp: bool, world: int) -> None:
    """Raise ``ValueError``/``TypeError`` naming the values and the fix; see Note [MoE meshes]."""
    for name, value in (("dp", dp), ("ep", ep), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"build_moe_meshes: {name} must be an int >= 1, got {name}={value!r}")
    if not isinstance(expert_tp, bool):
        raise TypeError(f"build_moe_meshes: expert_tp must be a bool, got {expert_tp!r}")
    if dp * tp != world:
        raise ValueError(
            f"build_moe_meshes: dp * tp must equal the world size, got dp={dp}, tp={tp} "
            f"(dp * tp = {dp * tp}) for world size {world}; choose dp = {world} // tp"
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
        raise ValueError(
            f"build_moe_meshes: when EP borrows the tp ranks (expert_tp=False, tp={tp}), ep must "
            f"be a multiple of tp and divide the world size; got ep={ep}, tp={tp}, "
            f"world={world}; use ep in {_borrowing_eps(tp, world)} or expert_tp=True"
        )


def _borrowing_eps(tp: int, world: int) -> list[int]:
    return [ep for ep in range(tp, world + 1, tp) if world % ep == 0]


def build_moe_meshes(
    *, dp: int, ep: int, tp: int = 1, expert_tp: bool = False, device_type: str = "cpu"
) -> MoEMeshes:
    """Build the dense ``("dp", "tp")`` and expert ``("edp", "ep", "etp")`` meshes.

    Keyword Args:
        dp: data-parallel degree of the dense params; ``dp * tp`` must be the world size.
        ep: expert-parallel degree (``1``: experts not sharded on an ep dim).
        tp: tensor/sequence-parallel degree of the dense layers.
        expert_tp: shard each expert on the tp ranks too (EP x TP, ``ep`` divides ``dp``);
            ``False``: EP borrows the tp ranks (``ep`` a multiple of ``tp`` dividing the world).
        device_type: passed to ``init_device_mesh``.

    Returns:
        :class:`MoEMeshes`. Creating the meshes creates their process groups (``new_group``
        calls on every rank); nothing else communicates. A second call with the same arguments
        under the same default group returns the same meshes while they are alive (Note [One
        mesh per layout]); the memo holds them weakly (Note [Mesh memo]).

    Raises:
        ValueError: before any process group is created, when the degrees do not fit the world
            size or each other (see Note [MoE meshes]).

    Example::

        meshes = build_moe_meshes(dp=2, ep=2, tp=2, expert_tp=True)   # 4 ranks, EP2 x TP2
        meshes.expert["ep"], meshes.expert["etp"], meshes.dense["tp"]
    """
    world = _world_size()
    _check_degrees(dp, ep, tp, expert_tp, world)
    key = (dp, ep, tp, expert_tp, device_type)
    built = _live_entry(key)  # Note [One mesh per layout], Note [Mesh memo]
    dense = None if built is None else built.dense()
    expert = None if built is None else built.expert()
    if dense is None:
        dense = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    if expert is None:
        etp = tp if expert_tp else 1
        expert = init_device_mesh(
            device_type, (world // (ep * etp), ep, etp), mesh_dim_names=("edp", "ep", "etp")
        )
    meshes = MoEMeshes(dp=dp, ep=ep, tp=tp, expert_tp=expert_tp, dense=dense, expert=expert)
    _BUILT[key] = _Built(*(weakref.ref(x) for x in (dist.group.WORLD, dense, expert)))
    return meshes


def _live_entry(key: tuple) -> _Built | None:
    """The memo entry for ``key`` if it was built under the current default group (dropping
    dead entries), after a ``gc.collect()`` that makes liveness agree across ranks."""
    if key in _BUILT:
        gc.collect()  # Note [Mesh memo]: "alive" must mean "reachable" on every rank
    current = dist.group.WORLD if dist.is_initialized() else None
    for k, built in list(_BUILT.items()):
        dead = built.dense() is None and built.expert() is None
        if built.world() is not current or current is None or dead:
            del _BUILT[k]
    return _BUILT.get(key)


# Note [Ranks of a mesh, read once]
# A mesh's ranks and this process's position in it never change, but reading them costs a
# tensor-to-list conversion (``mesh.mesh.tolist()``) or a process-group lookup
# (``get_local_rank``), and under ``torch.compile`` both are host reads of tensor data that
# break the graph. So the objects that need them (dispatchers, the token-parallel forward)
# read them once, at construction, through the two helpers below, and keep them as plain
# ints and tuples: this is the one place the local rank comes from.


def mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of ``mesh`` in its row-major order, as a tuple of ints."""
    return tuple(mesh.mesh.flatten().tolist())


def local_rank(mesh: DeviceMesh) -> int:
    """This process's index in the 1-D ``mesh``; ``ValueError`` if it is not a member."""
    if mesh.ndim != 1:
        raise ValueError(f"local_rank needs a 1-D DeviceMesh, got {mesh} ({mesh.ndim}-D)")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(
            f"this process (rank {dist.get_rank()}) is not a member of {mesh}; build the "
            "layer's meshes on every rank that runs it"
        )
    return coordinate[0]
