"""The parallel layout of the demo model: every sharding decision lives in :func:`apply_layout`.

Note [Demo layout]
~~~~~~~~~~~~~~~~~~
``apply_layout`` turns the single-device :class:`~dtensor_moe.demo.model.MoETransformer` into a
distributed one, in three steps that only use public PyTorch and dtensor_moe APIs:

1. **Tensor (and sequence) parallelism of the dense layers** on ``meshes.dense["tp"]`` with
   :func:`dtensor_moe.parallelize_dense`, whose default names are this model's. With sequence
   parallelism the residual stream between blocks is a ``Shard(1)`` DTensor (uneven when ``L``
   is not a multiple of ``tp``: DTensor pads the collectives itself); without it, it is a plain
   tensor, the same on every tp rank (Note [Dense plan and the residual stream] in
   ``dtensor_moe/parallel/dense.py``).

   ===========================  =========================================================
   module                       style
   ===========================  =========================================================
   ``tok_embeddings``           ``RowwiseParallel``: vocab rows sharded; out ``Shard(1)`` (SP)
                                or ``Replicate``
   ``*.attention_norm``,        ``SequenceParallel`` (SP only; replicated weights)
   ``*.moe_norm``, ``norm``
   ``*.attention``              ``PrepareModuleInput``: ``Shard(1)`` -> ``Replicate`` (SP only;
                                all-gather)
   ``*.attention.wq/wk/wv``     ``ColwiseParallel``: ``heads / tp`` heads per rank
   ``*.attention.wo``           ``RowwiseParallel``: out ``Shard(1)`` (SP, reduce-scatter) or
                                ``Replicate`` (all-reduce)
   ``output``                   ``ColwiseParallel``: logits all-gathered to ``Replicate``
   ===========================  =========================================================

2. **The MoE layers** with :func:`dtensor_moe.parallelize_moe` (Note [MoE plan] in
   ``dtensor_moe/parallel/plan.py``): the experts split over ``"ep"`` with tokens moved by
   all-to-all (``ExpertParallel``), or also over ``"etp"`` (``ExpertTensorParallel``,
   ``--expert-tp``);
   on the tp mesh, ``PrepareMoEInput`` takes the residual layout (``Shard(1)`` or replicated)
   and hands back the same. With EP borrowing the tp ranks each tp rank routes only its own
   tokens (its sequence shard under SP), so no rank duplicates another's work.

3. **FSDP2** with :func:`dtensor_moe.fully_shard_moe`: the routed experts of each
   MoE on the expert mesh's ``"edp"`` dim, each block and then the root on the dense mesh's
   ``"dp"`` dim. The dense params end up on the 2-D ``("dp", "tp")`` mesh and the experts on
   the ``("edp", "ep"[, "etp"])`` mesh. One fused AdamW and one
   :func:`dtensor_moe.clip_grad_norm_` then work across both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_moe import MoEMeshes, fully_shard_moe, parallelize_dense, parallelize_moe
from dtensor_moe.demo.config import DemoConfig
from dtensor_moe.demo.model import MoETransformer
from dtensor_moe.parallel import DenseNames

__all__ = ["apply_layout", "apply_stage_layout", "describe_layout", "exchange_options"]


def exchange_options(config: DemoConfig) -> dict[str, Any] | None:
    """``parallelize_moe``'s ``exchange_options`` for ``--exchange``: the fixed exchange's
    ``buffer_factor`` (``--buffer-factor``); none for the other backends."""
    return {"buffer_factor": config.buffer_factor} if config.fixed else None


def apply_layout(
    model: MoETransformer,
    meshes: MoEMeshes,
    *,
    sequence_parallel: bool,
    exchange: str = "all_to_all",
    exchange_options: Mapping[str, Any] | None = None,
) -> None:
    """Shard ``model`` in place for ``meshes``; see Note [Demo layout].

    ``exchange`` and ``exchange_options`` go to :func:`dtensor_moe.parallelize_moe`: the
    backend that moves tokens to the experts of other ranks (``--exchange``, and for
    ``"fixed"`` its ``buffer_factor``).

    Collectives: torch's and the MoE styles scatter or broadcast each weight from the first
    rank of its mesh, and the MoE styles check that the config agrees across ranks (an object
    all-gather); everything else communicates from the first forward on.
    """
    sp = sequence_parallel and meshes.tp > 1
    if meshes.tp > 1:
        parallelize_dense(model, meshes.dense["tp"], sequence_parallel=sp)
    if meshes.tp > 1 or meshes.ep > 1:
        parallelize_moe(
            model, meshes, sequence_parallel=sp, exchange=exchange,
            exchange_options=exchange_options,
        )  # fmt: skip
    fully_shard_moe(model, meshes, blocks=model.layers)


def apply_stage_layout(
    stage: nn.Module,
    meshes: MoEMeshes,
    *,
    sequence_parallel: bool,
    exchange: str = "all_to_all",
    exchange_options: Mapping[str, Any] | None = None,
) -> None:
    """:func:`apply_layout` for one pipeline stage (``--pp``), on the stage's ``meshes``.

    ``stage`` is a :class:`~dtensor_moe.demo.pipeline.StageModel`: the model's names, without
    the embedding, final norm or LM head where another stage holds them. FSDP2 keeps the params
    gathered between forward and backward (``reshard_after_forward=False``), as
    docs/pipeline.md says to under a schedule.
    """
    sp = sequence_parallel and meshes.tp > 1
    if meshes.tp > 1:
        names = DenseNames(
            embedding="tok_embeddings" if stage.tok_embeddings is not None else None,
            final_norm="norm" if stage.norm is not None else None,
            output="output" if stage.output is not None else None,
        )
        parallelize_dense(stage, meshes.dense["tp"], sequence_parallel=sp, names=names)
    if meshes.tp > 1 or meshes.ep > 1:
        parallelize_moe(
            stage, meshes, sequence_parallel=sp, exchange=exchange,
            exchange_options=exchange_options,
        )  # fmt: skip
    fully_shard_moe(
        stage, meshes, blocks=list(stage.layers.values()), reshard_after_forward=False
    )


_PARAM_KINDS = (  # (name fragment, what to call it), first match wins
    ("tok_embeddings", "embeddings"),
    ("shared_experts", "shared experts"),
    ("experts", "routed experts"),
    ("router", "router"),
    ("attention.", "attention"),
    ("norm", "norms"),
    ("output", "LM head"),
)


def describe_layout(model: nn.Module) -> list[str]:
    """One line per mesh the params live on: the mesh, how many params, which kinds."""
    by_mesh: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        mesh = getattr(param, "device_mesh", None)
        key = "plain tensors" if mesh is None else _mesh_name(mesh)
        kind = next((k for fragment, k in _PARAM_KINDS if fragment in name), "other")
        by_mesh.setdefault(key, []).append(kind)
    return [
        f"{key}: {len(kinds)} params ({', '.join(dict.fromkeys(kinds))})"
        for key, kinds in by_mesh.items()
    ]


def _mesh_name(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
    return f"mesh ({dims})"
