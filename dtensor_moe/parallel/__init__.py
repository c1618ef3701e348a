"""Parallel layouts of an MoE model: device meshes, the dense and MoE plans, styles, padding.

See ``docs/parallelism.md``.
"""

from dtensor_moe.parallel.dense import DenseNames, dense_tp_plan, parallelize_dense
from dtensor_moe.parallel.fsdp import expert_shard_dim, fully_shard_moe
from dtensor_moe.parallel.grads import reduce_gradients
from dtensor_moe.parallel.mesh import MoEMeshes, build_moe_meshes
from dtensor_moe.parallel.overlap import overlap_f_b
from dtensor_moe.parallel.padding import ShardDim, TokenShardMeta
from dtensor_moe.parallel.pipeline import build_stage, check_batch, split_stage
from dtensor_moe.parallel.plan import parallelize_moe
from dtensor_moe.parallel.stages import check_schedule, check_stage_names
from dtensor_moe.parallel.style import ExpertParallel, ExpertTensorParallel, PrepareMoEInput
from dtensor_moe.parallel.token_parallel import TokenParallel, TokenSplit

__all__ = [
    "DenseNames",
    "ExpertParallel",
    "ExpertTensorParallel",
    "MoEMeshes",
    "PrepareMoEInput",
    "ShardDim",
    "TokenParallel",
    "TokenSplit",
    "TokenShardMeta",
    "build_moe_meshes",
    "build_stage",
    "check_schedule",
    "check_stage_names",
    "check_batch",
    "dense_tp_plan",
    "expert_shard_dim",
    "fully_shard_moe",
    "overlap_f_b",
    "parallelize_dense",
    "parallelize_moe",
    "reduce_gradients",
    "split_stage",
]
