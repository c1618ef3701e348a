"""ParallelStyles for the MoE layer: ExpertParallel, ExpertTensorParallel, PrepareMoEInput.

Use them with ``torch.distributed.tensor.parallel.parallelize_module``, or let
:func:`~dtensor_moe.parallel.parallelize_moe` build the plan. ``docs/parallelism.md`` lists the
placements at every boundary and how each gradient is reduced.

Note [Style application]
~~~~~~~~~~~~~~~~~~~~~~~~
A style's configuration is settled in ``__init__`` and never changed by ``_apply``. ``_apply``
runs, on every rank of the mesh:

1. checks that need no other rank (the module type, the mesh's number of dims), which are the
   same on every rank;
2. one object all-gather per mesh dim of ``(fingerprint, error)``: the layer's configuration
   and the result of this rank's own checks (for example ``num_experts % ep``). Every rank
   then holds every rank's pair and raises the same ``ValueError``, the first rank's error or
   a config mismatch, before any other collective, so no rank can hang waiting for one that
   raised;
3. distributes the weights (``distribute_tensor``: a scatter or broadcast from the mesh's first
   rank) and installs the exchange backend in the experts' plan, or the layer's ``token_parallel`` and its forward hooks.

No style keeps per-forward state: everything one forward needs is in the exchange's frozen values
or local variables, so the layer works under activation-checkpoint recompute and with several
micro-batches in flight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from dtensor_moe import _compat
from dtensor_moe.moe.layer import MoE
from dtensor_moe.routed import GroupedExperts, TokenExchange, exchange_class
from dtensor_moe.parallel.objects import all_gather_objects
from dtensor_moe.parallel.token_parallel import (
    INPUT_LAYOUTS,
    ROUTINGS,
    Routing,
    TokenParallel,
)

__all__ = ["ExpertParallel", "ExpertTPDispatch", "ExpertTensorParallel", "PrepareMoEInput"]

ExpertTPDispatch: TypeAlias = Literal["all_to_all", "gather"]


def _gather_over_mesh(value: Any, mesh: DeviceMesh) -> list[Any]:
    """Every rank's ``value``, in mesh order, on every rank (one object all-gather per dim,
    without numpy: Note [Object collectives without numpy] in ``objects.py``)."""
    values = [value]
    for dim in range(mesh.ndim):
        gathered = all_gather_objects(values, mesh.get_group(dim), mesh.device_type)
        values = [v for part in gathered for v in part]
    return values


def _agree_or_raise(mesh: DeviceMesh, what: str, fingerprint: Any, error: str | None) -> None:
    """Step 2 of Note [Style application]: the same error on every rank, or none."""
    pairs = _gather_over_mesh((fingerprint, error), mesh)
    errors = [e for _, e in pairs if e is not None]
    if errors:
        raise ValueError(errors[0])
    fingerprints = [f for f, _ in pairs]
    if any(f != fingerprints[0] for f in fingerprints):
        ranks = mesh.mesh.flatten().tolist() if mesh.ndim > 1 else mesh.mesh.tolist()
        differing = {r: f for r, f in zip(ranks, fingerprints) if f != fingerprints[0]}
        raise ValueError(
            f"{what} differs across the ranks of {mesh}: rank {ranks[0]} has "
            f"{fingerprints[0]}, but {differing}; build the same layer on every rank"
        )


def _distribute_param(
    module: nn.Module, name: str, mesh: DeviceMesh, placements: Sequence[Placement]
) -> None:
    param = getattr(module, name)
    dparam = nn.Parameter(
        distribute_tensor(param.data, mesh, list(placements)), param.requires_grad
    )
    module.register_parameter(name, dparam)


def _replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter of ``module`` and its children that is not a DTensor yet becomes a
    ``Replicate()`` DTensor on ``mesh`` (an adapter swapped in before the style included)."""
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                _distribute_param(sub, name, mesh, [Replicate()])


def _check_module(module: nn.Module, cls: type, style: str) -> None:
    if not isinstance(module, cls):
        raise TypeError(
            f"{style} applies to a {cls.__name__} (for example the 'experts' child of an MoE), "
            f"got {type(module).__name__}"
        )
    if isinstance(module, FSDPModule):
        raise ValueError(
            f"{style}: {type(module).__name__} is already sharded with fully_shard (FSDP2); "
            "apply the parallel styles first (parallelize_moe), then fully_shard_moe"
        )
    already = [n for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
    if already:
        raise ValueError(f"{style}: {type(module).__name__} is already parallelized ({already})")


def _check_ndim(mesh: DeviceMesh, allowed: tuple[int, ...], style: str, hint: str) -> None:
    if mesh.ndim not in allowed:
        raise ValueError(
            f"{style} needs a {' or '.join(f'{n}-D' for n in allowed)} DeviceMesh, got a "
            f"{mesh.ndim}-D mesh {mesh}; {hint}"
        )


def _experts_fingerprint(module: GroupedExperts) -> tuple:
    plan, ex = module.plan, module.plan.exchange
    return (
        tuple(module.w1.shape),
        tuple(module.w2.shape),
        str(module.w1.dtype),
        plan.kernel,
        plan.memory,
        plan.recompute,
        ex.num_experts,
        ex.pad_multiple,
        ex.score_before_experts,
    )


ExchangeName: TypeAlias = str | type[TokenExchange]


def _check_exchange(exchange: Any, style: str) -> None:
    """A registered backend name or class (Note [Exchange protocol] in
    ``routed/exchange.py``), at construction: the same on every rank."""
    try:
        cls = exchange_class(exchange)
    except ValueError as err:
        raise ValueError(f"{style}: {err}") from None
    if cls.name == "local":
        raise ValueError(
            f"{style}(exchange='local'): the local exchange sends no rows, so it cannot serve "
            "expert parallelism; use 'all_to_all', 'all_gather' or 'fixed' (without a mesh "
            "of more than one rank the styles install the local exchange themselves)"
        )


def _named(exchange: ExchangeName) -> str:
    """``"exchange=..., "`` for a repr, empty for the default backend."""
    return "" if exchange == "all_to_all" else f"exchange={exchange!r}, "


def _install_exchange(
    module: GroupedExperts,
    exchange: ExchangeName,
    *,
    mesh: DeviceMesh | None,
    overlap: bool,
    replicas: int = 1,
    partial_mesh: DeviceMesh | None = None,
    options: Mapping[str, Any] | None = None,
) -> None:
    """Put the experts' plan on ``mesh`` with the named backend (the local one without a
    mesh); the layout settings (padding, where the scores apply) stay the plan's."""
    old = module.plan.exchange
    cls = exchange_class("local" if mesh is None else exchange)
    new = cls(
        num_experts=old.num_experts,
        pad_multiple=old.pad_multiple,
        score_before_experts=old.score_before_experts,
        mesh=mesh,
        replicas=replicas,
        partial_mesh=partial_mesh,
        overlap=overlap,
        **({} if mesh is None or options is None else options),
    )
    module.plan = module.plan.with_exchange(new)


class ExpertParallel(ParallelStyle):
    """Shard the routed experts over a 1-D expert-parallel mesh (``Shard(0)``).

    Apply to the ``experts`` child of an :class:`~dtensor_moe.moe.MoE`::

        parallelize_module(moe, meshes.expert["ep"], {"experts": ExpertParallel()})

    ``w1``/``w2``/``w3`` become ``Shard(0)`` DTensors (rank ``p`` of ``ep`` holds experts
    ``[p * E / ep, (p + 1) * E / ep)``) and the experts' plan takes the ``exchange`` backend on
    the mesh. The ranks may hold
    different tokens (data-parallel ranks, "dp2ep") or the tp ranks of a sequence-parallel
    block (with :class:`PrepareMoEInput` ``routing="split"``). Expert weight gradients are
    ``Shard(0)`` DTensors holding the complete gradient of the local experts.

    Collectives: applying runs one object all-gather (config check; two ``all_gather`` calls)
    and the weight scatter;
    forward: ``all_to_all_single`` x 3; backward: ``all_to_all_single`` x 2, all on the mesh.

    Args:
        exchange_options: keyword arguments of the backend's own (``"fixed"``:
            ``buffer_factor``).
        exchange: the backend, by registered name or class (Note [Exchange protocol] in
            ``routed/exchange.py``): ``"all_to_all"`` (default) sends each row to the rank of
            its expert; ``"all_gather"`` gathers every rank's tokens and routing and returns
            the outputs by reduce-scatter (better at small EP degrees and high top-k).
        overlap: compute this rank's own rows while the other rows travel (Note [Own rows] in
            ``routed/all_to_all.py``), ``True`` by default where the backend can; ``False``
            sends every row through the exchange. Same results; the parity tests run both.

    Precondition: the ranks of the mesh route different tokens (different data, or the tp
    ranks of a block under :class:`PrepareMoEInput` ``routing="split"``). Ranks routing the same
    tokens would make expert gradients too large by their number; the first training forward
    checks this with one ``all_gather`` of a token checksum and raises ``ValueError`` on every
    rank (every forward under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

    Raises:
        ValueError: the mesh is not 1-D, ``num_experts`` is not divisible by its size, or the
            experts' configuration differs across its ranks (on every rank, before any data
            collective; see Note [Style application]).
    """

    def __init__(
        self,
        *,
        exchange: ExchangeName = "all_to_all",
        overlap: bool = True,
        exchange_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(overlap, bool):
            raise TypeError(f"ExpertParallel: overlap must be a bool, got {overlap!r}")
        _check_exchange(exchange, "ExpertParallel")
        self.exchange = exchange
        self.overlap = overlap
        self.exchange_options = dict(exchange_options or {})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = type(self).__name__
        _check_module(module, GroupedExperts, style)
        _check_ndim(device_mesh, (1,), style, 'pass a 1-D EP mesh such as meshes.expert["ep"]')
        ep, num_experts = device_mesh.size(), module.w1.shape[0]
        error = None
        if num_experts % ep != 0:
            error = (
                f"{style}: num_experts={num_experts} is not divisible by the expert-parallel "
                f"degree ep={ep}; choose ep among the divisors of num_experts"
            )
        _agree_or_raise(
            device_mesh, "the experts' configuration", _experts_fingerprint(module), error
        )
        for name in ("w1", "w2", "w3"):
            _distribute_param(module, name, device_mesh, [Shard(0)])
        _install_exchange(
            module, self.exchange, mesh=device_mesh if ep > 1 else None, overlap=self.overlap,
            options=self.exchange_options,
        )  # fmt: skip
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_named(self.exchange)}overlap={self.overlap})"


class ExpertTensorParallel(ParallelStyle):
    """Shard each routed expert's hidden dim (and the experts, on a 2-D mesh).

    Keyword Args:
        dispatch: how the tokens reach the ``etp`` ranks that share an expert.
            ``"all_to_all"`` (default): each rank routes its own tokens and the all-to-all sends
            every row to all ``etp`` ranks holding its expert, which return partial outputs that
            the sender sums (Note [Expert TP by all-to-all]); the experts' output is complete.
            Use with :class:`PrepareMoEInput` ``routing="split"``.
            ``"gather"``: every ``etp`` rank routes all tokens of the group (gathered by
            :class:`PrepareMoEInput` ``routing="replicate"``) and the experts' output is a
            ``Partial`` DTensor on the ``etp`` mesh, reduced to the input layout.
        exchange, overlap: as for :class:`ExpertParallel`; ``dispatch="all_to_all"`` needs a
            backend with the ``expert_tp`` feature (``"all_to_all"``).

    On a 2-D ``(ep, etp)`` mesh (for example ``meshes.expert["ep", "etp"]``): ``w1``/``w3``
    (``(E, H, D)``) become ``[Shard(0), Shard(1)]`` and ``w2`` (``(E, D, H)``)
    ``[Shard(0), Shard(2)]``. On a 1-D ``etp`` mesh (expert tensor parallelism alone):
    ``[Shard(1)]`` and ``[Shard(2)]``. Weight gradients keep these placements.

    Collectives: applying runs one object all-gather (two ``all_gather`` calls) per mesh dim
    and the weight scatter.
    Forward ``all_to_all_single`` x 3, backward x 2: over all ranks of the mesh
    (``"all_to_all"``), or over ``ep`` (``"gather"``; none on a 1-D mesh).
    The ranks that exchange rows must route different tokens, as for :class:`ExpertParallel`
    (checked the same way on the first training forward).

    Raises:
        ValueError: an unknown ``dispatch``; the mesh is not 1-D or 2-D, a 2-D mesh has no
            dim names, ``num_experts`` is not divisible by ``ep`` or ``hidden_dim`` by ``etp``,
            or the configuration differs across ranks.
    """

    def __init__(
        self,
        *,
        dispatch: ExpertTPDispatch = "all_to_all",
        exchange: ExchangeName = "all_to_all",
        overlap: bool = True,
        exchange_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if dispatch not in ("all_to_all", "gather"):
            raise ValueError(
                f"ExpertTensorParallel: dispatch must be 'all_to_all' or 'gather', got {dispatch!r}"
            )
        if not isinstance(overlap, bool):
            raise TypeError(f"ExpertTensorParallel: overlap must be a bool, got {overlap!r}")
        _check_exchange(exchange, "ExpertTensorParallel")
        if dispatch == "all_to_all" and "expert_tp" not in exchange_class(exchange).features:
            raise ValueError(
                f"ExpertTensorParallel(dispatch='all_to_all') sends each row to every hidden "
                f"slice of its expert, which the {exchange_class(exchange).name!r} exchange does "
                "not support (no 'expert_tp' feature); use exchange='all_to_all', or "
                "dispatch='gather'"
            )
        self.dispatch = dispatch
        self.exchange = exchange
        self.overlap = overlap
        self.exchange_options = dict(exchange_options or {})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = repr(self)
        _check_module(module, GroupedExperts, style)
        hint = 'pass meshes.expert["ep", "etp"] or a 1-D tp mesh'
        _check_ndim(device_mesh, (1, 2), style, hint)
        if device_mesh.ndim == 2 and device_mesh.mesh_dim_names is None:
            raise ValueError(f"{style} needs a 2-D mesh with dim names (ep, etp); {hint}")
        names = device_mesh.mesh_dim_names
        ep_mesh = device_mesh[names[0]] if device_mesh.ndim == 2 else None
        etp_mesh = device_mesh[names[1]] if device_mesh.ndim == 2 else device_mesh
        error = self._divisibility_error(module, ep_mesh, etp_mesh)
        fingerprint = _experts_fingerprint(module)
        _agree_or_raise(device_mesh, "the experts' configuration", fingerprint, error)
        lead = [Shard(0)] if ep_mesh is not None else []
        for name, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
            _distribute_param(module, name, device_mesh, [*lead, Shard(dim)])
        if self.dispatch == "all_to_all":
            mesh = _compat.flatten_mesh(device_mesh)
            _install_exchange(module, self.exchange, mesh=mesh, replicas=etp_mesh.size(),
                              overlap=self.overlap, options=self.exchange_options)  # fmt: skip
        else:
            ep_used = ep_mesh if ep_mesh is not None and ep_mesh.size() > 1 else None
            _install_exchange(module, self.exchange, mesh=ep_used, partial_mesh=etp_mesh,
                              overlap=self.overlap, options=self.exchange_options)  # fmt: skip
        return module

    @staticmethod
    def _divisibility_error(
        module: GroupedExperts, ep_mesh: DeviceMesh | None, etp_mesh: DeviceMesh
    ) -> str | None:
        E, H = module.w1.shape[0], module.w1.shape[1]
        ep, etp = (1 if ep_mesh is None else ep_mesh.size()), etp_mesh.size()
        if E % ep != 0:
            return (
                f"ExpertTensorParallel: num_experts={E} is not divisible by the expert-parallel "
                f"degree ep={ep}; choose ep among the divisors of num_experts"
            )
        if H % etp != 0:
            return (
                f"ExpertTensorParallel: hidden_dim={H} is not divisible by the expert "
                f"tensor-parallel degree etp={etp}; choose hidden_dim a multiple of etp"
            )
        return None

    def __repr__(self) -> str:
        name, dispatch = type(self).__name__, self.dispatch
        return f"{name}(dispatch={dispatch!r}, {_named(self.exchange)}overlap={self.overlap})"


class PrepareMoEInput(ParallelStyle):
    """The MoE layer's tensor/sequence-parallel plan on a 1-D tp mesh.

    Keyword Args:
        input_layout: ``Shard(1)`` (sequence parallel; uneven lengths allowed) or
            ``Replicate()``: the placement of the MoE input on the tp mesh. The output comes
            back in the same layout (a plain tensor in, ``Replicate()``, gives a plain tensor
            out).
        routing: ``"split"``: each tp rank routes its own tokens (its sequence shard, or a
            ``1/tp`` slice of a replicated input); use with :class:`ExpertParallel` over an EP
            mesh that contains the tp ranks (EP borrows TP). ``"replicate"``: every tp rank
            routes all tokens of the tp group; use with :class:`ExpertTensorParallel` on the
            tp ranks. See Note [Token-parallel MoE].

    Apply to an :class:`~dtensor_moe.moe.MoE`::

        parallelize_module(moe, meshes.dense["tp"], PrepareMoEInput(input_layout=Shard(1)))

    The router gate becomes ``Replicate()`` on the tp mesh; the shared experts ``Replicate()``
    under ``"split"``, and column-wise (``w1``, ``w3``: ``Shard(0)``) and row-wise (``w2``:
    ``Shard(1)``) under ``"replicate"``. Replicated weights used on split tokens get
    ``Partial`` gradients: FSDP2, the fused optimizer or ``full_tensor()`` reduce them over tp.

    The style composes around the layer's own forward, as torch's styles do: a forward
    pre-hook prepares the tokens this rank routes and a forward hook brings the output back to
    the input's layout (:class:`~dtensor_moe.parallel.token_parallel.TokenParallel`); the
    router, its gate and the shared experts are called as modules, so their hooks, separate
    ``fully_shard`` units, ``checkpoint_wrapper`` and adapters swapped in before the style
    (their parameters are replicated too) work as in one process.

    Collectives: see :class:`~dtensor_moe.parallel.token_parallel.TokenParallel`.

    Raises:
        ValueError: at construction for an unknown ``input_layout``/``routing``; when applied,
            for a mesh that is not 1-D or MoE configs that differ across the tp ranks; in
            forward, for an input with other placements or another mesh (before any
            collective).
    """

    def __init__(self, *, input_layout: Placement = Shard(1), routing: Routing = "split") -> None:
        super().__init__()
        if input_layout not in INPUT_LAYOUTS:
            raise ValueError(
                f"PrepareMoEInput: input_layout must be Shard(1) (sequence parallel) or "
                f"Replicate(), got {input_layout!r}"
            )
        if routing not in ROUTINGS:
            raise ValueError(
                f"PrepareMoEInput: routing must be 'split' (EP borrows the tp ranks) or "
                f"'replicate' (expert tensor parallelism), got {routing!r}"
            )
        self.input_layout = input_layout
        self.routing = routing

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = repr(self)
        if not isinstance(module, MoE):
            raise TypeError(f"{style} applies to an MoE layer, got {type(module).__name__}")
        if module.token_parallel is not None:
            raise ValueError(f"{style}: this MoE already has a token-parallel plan")
        _check_ndim(device_mesh, (1,), style, 'pass the 1-D tp mesh such as meshes.dense["tp"]')
        _agree_or_raise(device_mesh, "the MoE config", module.config, None)
        _replicate_params(module.router, device_mesh)
        if module.shared_experts is not None:
            shared = module.shared_experts
            if self.routing == "replicate":  # column-wise w1/w3, row-wise w2
                for name, dim in (("w1", 0), ("w2", 1), ("w3", 0)):
                    _distribute_param(getattr(shared, name), "weight", device_mesh, [Shard(dim)])
            _replicate_params(shared, device_mesh)  # the rest (all under "split"), the gate
        plan = TokenParallel(mesh=device_mesh, input_layout=self.input_layout, routing=self.routing)
        module.token_parallel = plan
        module.register_forward_pre_hook(plan.input_hook, with_kwargs=True)
        module.register_forward_hook(plan.output_hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layout={self.input_layout!r}, routing={self.routing!r})"
        )
