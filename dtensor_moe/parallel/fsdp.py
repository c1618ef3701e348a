"""FSDP2 for models that contain :class:`~dtensor_moe.MoE` layers.

Note [FSDP2 with experts]
~~~~~~~~~~~~~~~~~~~~~~~~~
In an MoE model the routed experts and the dense params are data-parallel over different
groups (see Note [MoE meshes] in ``mesh.py``):

* every ``moe.experts`` module gets its own FSDP group on the expert mesh's ``"edp"`` dim; its
  params may already be DTensors on ``"ep"``/``"etp"`` (from the parallel styles), and FSDP2
  stacks its own shard on top (the ``"edp"`` dim is the outer dim of the same expert mesh).
* everything else (attention, router, shared experts, embeddings, norms) is sharded on the
  dense mesh's ``"dp"`` dim: one group per block passed in ``blocks`` plus one at the root.

Gradient scaling. The training loss is a mean over the ``dp`` data-parallel batches, so every
gradient must be averaged over ``dp`` batches. FSDP averages over the size of the mesh it
reduces on: that is right for the dense params (``"dp"``), but the expert FSDP group reduces
over ``edp = world / (ep * etp)`` ranks while its gradients already sum the tokens of all the
ranks that the all-to-all gathered. So the expert groups divide by ``dp`` instead
(``set_gradient_divide_factor``), which makes their gradients the exact global mean.

On CPU (gloo) the expert groups also set ``set_force_sum_reduction_for_comms(True)``: a custom
divide factor makes FSDP2 use ``ReduceOp.PREMUL_SUM``, which gloo does not implement. Except
when ``edp == 1``: FSDP2 then runs no collective and divides once, but with a forced SUM it
divides a second time (torch 2.13). ``tests/test_fsdp_moe.py`` keeps tests for both torch
behaviours.

Small expert counts. When the ``num_experts // ep`` experts each rank holds after EP do not
split evenly over ``edp``, a ``Shard(0)`` on the expert dim would leave FSDP ranks without a
whole expert; the expert weights then shard on dim 1 (the hidden dim of ``w1``/``w3``, the model
dim of ``w2``). FSDP2 shards a dim other than 0 only evenly, and it splits the *local* shard of
a DTensor param: under expert TP that is ``hidden_dim // etp`` for ``w1``/``w3`` and ``dim`` for
``w2``. ``fully_shard_moe`` checks every expert weight's local size on that dim before its first
``fully_shard`` call (so before any FSDP collective; every rank sees the same sizes) and raises a
``ValueError`` naming the weight, its size and ``edp``.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from dtensor_moe.moe.layer import MoE
from dtensor_moe.parallel.mesh import MoEMeshes

__all__ = ["expert_shard_dim", "fully_shard_moe"]


def expert_shard_dim(num_experts: int, meshes: MoEMeshes) -> int:
    """The dim FSDP shards the expert weights on: 0 when every ``"edp"`` rank gets whole experts.

    ``num_experts // ep`` experts remain per rank after EP; FSDP splits them over ``edp`` ranks.
    """
    local_experts = num_experts // meshes.ep
    return 0 if local_experts % meshes.edp == 0 else 1


def _as_blocks(blocks: Iterable[nn.Module] | nn.ModuleDict) -> list[nn.Module]:
    """The blocks as a list: the values of an ``nn.ModuleDict`` (or any mapping of modules)."""
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, str):
        raise TypeError(f"fully_shard_moe: blocks must be modules, got the string {blocks!r}")
    return list(blocks)


def _reshard(reshard_after_forward: bool | None, meshes: MoEMeshes) -> bool:
    """Note [FSDP2 under V schedules]: ``None`` means ``True`` without pipeline parallelism and
    ``False`` with it."""
    if reshard_after_forward is None:
        return meshes.pp == 1
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"fully_shard_moe: reshard_after_forward must be a bool or None, got "
            f"{reshard_after_forward!r}"
        )
    return reshard_after_forward


def _check_model(model: nn.Module, meshes: MoEMeshes, blocks: list[nn.Module]) -> list[MoE]:
    """Every check of :func:`fully_shard_moe`; local, so every rank raises before any collective."""
    if not isinstance(meshes, MoEMeshes):
        raise TypeError(
            f"fully_shard_moe expects the MoEMeshes of build_moe_meshes(...), got "
            f"{type(meshes).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"fully_shard_moe: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, FSDPModule):
        raise ValueError("fully_shard_moe: the model is already sharded with fully_shard")
    owned = {id(m) for m in model.modules()}
    for block in blocks:
        if id(block) not in owned or block is model:
            raise ValueError(
                f"fully_shard_moe: every entry of blocks must be a strict submodule of the model; "
                f"got {type(block).__name__}; pass the blocks themselves (the values of an "
                "nn.ModuleDict, the entries of an nn.ModuleList)"
            )
    moes = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    for name, moe in moes:
        _check_expert_shard_dim(name, moe, meshes)
    return [m for _, m in moes]


def _check_expert_shard_dim(name: str, moe: MoE, meshes: MoEMeshes) -> None:
    """FSDP2 shards a dim other than 0 only evenly: check each expert weight's *local* size.

    Under expert TP the weights are already DTensors whose local shard (for example ``w1``'s
    ``H / etp`` rows) is what FSDP2 splits; ``w2`` is ``(E, D, H)``, so its dim 1 is ``D``.
    """
    dim = expert_shard_dim(moe.config.num_experts, meshes)
    if dim == 0:
        return  # FSDP2 pads an uneven dim 0 itself
    edp, local_experts = meshes.edp, moe.config.num_experts // meshes.ep
    prefix = f"{name}.experts" if name else "experts"
    for pname, param in moe.experts.named_parameters():
        local_shape = tuple((param.to_local() if isinstance(param, DTensor) else param).shape)
        if len(local_shape) > dim and local_shape[dim] % edp == 0:
            continue
        size = local_shape[dim] if len(local_shape) > dim else None
        raise ValueError(
            f"fully_shard_moe: {moe.config.num_experts} experts over ep={meshes.ep} leave "
            f"{local_experts} per rank, which does not split over the edp={edp} "
            f"expert-data-parallel ranks, so FSDP2 shards the expert weights on dim {dim}, "
            f"which it requires to be divisible by edp; but {prefix}.{pname} has local shape "
            f"{local_shape} (global {tuple(param.shape)}), whose dim {dim} has size {size}, not "
            f"divisible by edp={edp}. Fix: make num_experts // ep a multiple of edp (the "
            f"experts then shard on dim 0), or choose dim and hidden_dim // etp (etp="
            f"{meshes.etp}) divisible by edp"
        )


def fully_shard_moe(
    model: nn.Module,
    meshes: MoEMeshes,
    *,
    blocks: Iterable[nn.Module] | nn.ModuleDict = (),
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2: routed experts on ``"edp"``, the rest on ``"dp"``.

    Apply the parallel styles (EP/TP/SP) first, then this. See Note [FSDP2 with experts].

    Args:
        model: a module containing :class:`~dtensor_moe.MoE` layers (anywhere inside).
        meshes: from :func:`~dtensor_moe.parallel.build_moe_meshes`.

    Keyword Args:
        blocks: submodules (e.g. transformer blocks) that get an FSDP group each, so their
            all-gathers overlap with compute; the root gets the remaining params. An
            ``nn.ModuleList``, a list, or an ``nn.ModuleDict`` (its values).
        reshard_after_forward: passed to every ``fully_shard`` call. ``None`` (the default):
            ``True`` when ``meshes.pp == 1``, ``False`` under pipeline parallelism, where the
            V-shaped schedules need it (Note [FSDP2 under V schedules] in
            ``dtensor_moe/parallel/stages.py``).
        mp_policy: mixed-precision policy passed to every ``fully_shard`` call.

    Returns:
        ``model``, now an ``FSDPModule``. Collectives (per FSDP group): all-gather of params in
        forward (and backward with ``reshard_after_forward``), reduce-scatter of grads in
        backward.

    Raises:
        TypeError: ``meshes`` is not an :class:`MoEMeshes`, ``reshard_after_forward`` is not a
            bool or ``None``.
        ValueError: the model is already sharded, a block is not a strict submodule, or an
            expert weight does not split over ``edp``.

    Example::

        meshes = build_moe_meshes(dp=4, ep=2)
        parallelize_moe(model, meshes)                      # EP styles
        fully_shard_moe(model, meshes, blocks=model.layers)
        opt = torch.optim.AdamW(model.parameters(), fused=True)   # one optimizer, two meshes
    """
    blocks = _as_blocks(blocks)
    moes = _check_model(model, meshes, blocks)
    kwargs: dict = {"reshard_after_forward": _reshard(reshard_after_forward, meshes)}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for moe in moes:
        dim = expert_shard_dim(moe.config.num_experts, meshes)
        fully_shard(
            moe.experts,
            mesh=meshes.expert["edp"],
            shard_placement_fn=lambda _param, _dim=dim: Shard(_dim),
            **kwargs,
        )
        moe.experts.set_gradient_divide_factor(float(meshes.dp))
        if meshes.expert.device_type == "cpu" and meshes.edp > 1:
            # Note [Gloo and divide factors]: with a divide factor other than the group size,
            # FSDP2 reduce-scatters with ReduceOp.PREMUL_SUM, which gloo rejects; plain SUM and
            # a separate division give the same result. Not on a 1-rank group: there torch 2.13
            # skips the collective, divides once, then divides again after a forced SUM.
            moe.experts.set_force_sum_reduction_for_comms(True)
    for block in blocks:
        fully_shard(block, mesh=meshes.dense["dp"], **kwargs)
    fully_shard(model, mesh=meshes.dense["dp"], **kwargs)
    return model

