"""Parallel layouts of the MoE layer: device meshes, virtual-padding metadata, styles.

See ``docs/parallelism.md``.
"""

from dtensor_moe.parallel.dispatch import AllToAllMetadata, AllToAllTokenDispatcher
from dtensor_moe.parallel.fsdp import expert_shard_dim, fully_shard_moe
from dtensor_moe.parallel.mesh import MoEMeshes, build_moe_meshes
from dtensor_moe.parallel.padding import ShardDim, TokenShardMeta
from dtensor_moe.parallel.plan import parallelize_moe
from dtensor_moe.parallel.style import ExpertParallel, ExpertTensorParallel, PrepareMoEInput
from dtensor_moe.parallel.token_parallel import TokenParallel, TokenSplit

__all__ = [
    "AllToAllMetadata",
    "AllToAllTokenDispatcher",
    "ExpertParallel",
    "ExpertTensorParallel",
    "MoEMeshes",
    "PrepareMoEInput",
    "ShardDim",
    "TokenParallel",
    "TokenSplit",
    "TokenShardMeta",
    "build_moe_meshes",
    "expert_shard_dim",
    "fully_shard_moe",
    "parallelize_moe",
]
