"""Pipeline parallelism of the demo (``--pp``): the stages, their schedule, the reported loss.

Note [Demo pipeline]
~~~~~~~~~~~~~~~~~~~~
``build_moe_meshes(pp=P, ...)`` splits the ``P * dp * tp`` ranks into ``P`` stages of consecutive
ranks; each stage gets the layout of ``--dp/--tp/--ep`` (``apply_stage_layout`` in
``layout.py``). Every rank builds the whole model from the seed, then keeps its stages, the
torchtitan way: :class:`StageModel` holds a stage's blocks in an ``nn.ModuleDict`` keyed by
their index, so every param keeps the full model's name (``layers.3.moe...``), which the parity
check of the params relies on. ``1f1b`` and ``gpipe`` run one stage per pp rank;
``interleaved`` (``ScheduleInterleaved1F1B``) runs two, stage ``r`` and ``r + pp`` on pp rank
``r``. The blocks are split evenly between the stages.

- **Between stages** the residual stream is a plain tensor ``(b, L, D)``, the same on every tp
  rank (what torch's ``PipelineStage`` sends). Under sequence parallelism a stage turns it into
  the ``Shard(1)`` DTensor its blocks expect (a local split, no communication) and all-gathers
  its output back; so any ``--seq-len`` works, including one that tp does not divide.
- **Data.** Pipeline ``d`` (dp rank ``d`` of every stage) takes rows ``d * batch / dp`` onwards
  of the step's global batch; the schedule splits them into ``--microbatches`` micro-batches.
  The last stage computes the cross-entropy of each; the schedule divides every gradient by
  the number of micro-batches, and FSDP2 averages over the ``dp`` pipelines. The demo has no
  router loss; its MoE layers use the attach route (``aux_loss_mode="attach"``), the one that
  works under a schedule (docs/pipeline.md).
- **The stages** come from ``build_stage`` (static metadata, so torch runs no shape-inference
  forward) and the step's grads pass ``reduce_gradients``, which leaves FSDP2's alone.
- **The step** then reduces across the stages: ``clip_grad_norm_(..., pp_mesh=meshes.pp_mesh)``,
  ``load_stats(stages, meshes=meshes)`` (every layer, on every rank) and
  ``update_expert_bias(stages, rate, meshes=meshes)`` (each stage's own layers). The reported
  loss, known on the last stage only, comes to every rank by one all-reduce.

The single-process rerun accumulates the same global micro-batches (``microbatch_rows`` in
``train.py``); parity then also compares every param after the last step (Note [Demo parity]).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtensor_moe import MoEMeshes
from dtensor_moe.demo.config import SCHEDULES, DemoConfig
from dtensor_moe.demo.layout import apply_stage_layout, exchange_options
from dtensor_moe.demo.model import MoETransformer
from dtensor_moe.demo.train import build_model
from dtensor_moe.parallel import build_stage, reduce_gradients

__all__ = ["Pipeline", "StageModel", "full_params", "stage_indices"]

_SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
}


class StageModel(nn.Module):
    """One pipeline stage of :class:`~dtensor_moe.demo.model.MoETransformer`, with its names.

    ``tok_embeddings`` only on the first stage, ``norm`` and ``output`` only on the last
    (``None`` elsewhere); ``layers`` maps the index of each block to it.
    """

    def __init__(
        self, model: MoETransformer, stage: int, num_stages: int, tp_mesh: DeviceMesh | None
    ) -> None:
        super().__init__()
        per_stage = len(model.layers) // num_stages
        first, last = stage == 0, stage == num_stages - 1
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict(
            {str(i): model.layers[i] for i in range(stage * per_stage, (stage + 1) * per_stage)}
        )
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.tp_mesh = tp_mesh  # sequence parallelism: the mesh of the Shard(1) residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``(b, L)`` on the first stage, else the residual stream ``(b, L, D)``; returns
        the logits ``(b, L, V)`` on the last stage, else the residual stream."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)  # a Shard(1) DTensor under sequence parallelism
        elif self.tp_mesh is not None:
            h = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
            h = h.redistribute(self.tp_mesh, [Shard(1)])
        else:
            h = x
        for block in self.layers.values():
            h = block(h)
        if self.output is not None:
            return self.output(self.norm(h))
        if self.tp_mesh is not None:
            return h.redistribute(self.tp_mesh, [Replicate()]).to_local()
        return h


def stage_indices(config: DemoConfig, pp_rank: int) -> list[int]:
    """The stages pp rank ``pp_rank`` runs: itself, and ``pp_rank + pp`` when interleaved."""
    return [pp_rank + k * config.pp for k in range(SCHEDULES[config.schedule])]


def _loss(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BLV.flatten(0, 1), targets_BL.flatten())


@dataclasses.dataclass(kw_only=True)
class Pipeline:
    """This rank's stages under the schedule of ``--schedule``; see Note [Demo pipeline]."""

    config: DemoConfig
    meshes: MoEMeshes
    indices: list[int]
    modules: nn.ModuleList
    schedule: object

    @classmethod
    def build(cls, config: DemoConfig, meshes: MoEMeshes) -> Pipeline:
        """Build the whole model from the seed, keep and shard this rank's stages, schedule."""
        model_config = dataclasses.replace(
            config.model, moe=dataclasses.replace(config.model.moe, aux_loss_mode="attach")
        )
        full = build_model(model_config, config.seed)
        sp = config.sequence_parallel and config.tp > 1
        tp_mesh = meshes.dense["tp"] if sp else None
        indices = stage_indices(config, meshes.pp_rank)
        num_stages = config.num_stages
        b, L, D = config.microbatch_size, config.seq_len, config.model.dim
        hidden = torch.empty(b, L, D)  # one micro-batch of one pipeline
        modules, stages = [], []
        for index in indices:
            module = StageModel(full, index, num_stages, tp_mesh)
            apply_stage_layout(
                module, meshes, sequence_parallel=config.sequence_parallel,
                exchange=config.exchange, exchange_options=exchange_options(config),
            )  # fmt: skip
            last = index == num_stages - 1
            stages.append(
                build_stage(
                    module,
                    meshes,
                    stage_index=index,
                    num_stages=num_stages,
                    input_args=torch.empty(b, L, dtype=torch.long) if index == 0 else hidden,
                    output_args=torch.empty(b, L, config.model.vocab_size) if last else hidden,
                )
            )
            modules.append(module)
        schedule_cls = _SCHEDULE_CLASSES[config.schedule]
        if len(stages) == 1:
            schedule = schedule_cls(stages[0], config.microbatches, loss_fn=_loss)
        else:
            schedule = schedule_cls(stages, config.microbatches, loss_fn=_loss)
        return cls(
            config=config,
            meshes=meshes,
            indices=indices,
            modules=nn.ModuleList(modules),
            schedule=schedule,
        )

    def step(self, inputs_BL: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of every micro-batch of this pipeline's rows; the mean
        cross-entropy over them on a rank that runs the last stage, else ``None``."""
        losses: list[torch.Tensor] = []
        last = self.config.num_stages - 1 in self.indices
        kwargs = dict(target=targets_BL, losses=losses) if last else {}
        self.schedule.step(*([inputs_BL] if 0 in self.indices else []), **kwargs)
        reduce_gradients(self.modules, self.meshes)  # FSDP2 reduced them: no collective
        return torch.stack(losses).detach().mean() if last else None

    def global_loss(self, loss: torch.Tensor | None) -> float:
        """The mean loss over the pipelines, on every rank (one all-reduce over all ranks)."""
        value = torch.zeros((), dtype=torch.float64) if loss is None else loss.to(torch.float64)
        dist.all_reduce(value)  # the last stage's dp * tp ranks; the tp ranks agree
        return float(value) / (dist.get_world_size() // self.config.pp)


def full_params(modules: nn.Module) -> dict[str, torch.Tensor]:
    """Every param of this rank's stages, gathered whole (``DTensor.full_tensor``), by name.

    Collective over each param's mesh: every rank of a stage calls it, in the same order.
    """
    out = {}
    # The experts' (_StridedShard, Shard) params gather in two steps, which DTensor logs as
    # suboptimal on every rank; one gather after training is fine.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        for name, param in modules.named_parameters():
            value = param.full_tensor() if isinstance(param, DTensor) else param
            out[name.split(".", 1)[1]] = value.detach().clone()  # drop the ModuleList index
    finally:
        log.setLevel(level)
    return out
