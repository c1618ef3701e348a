"""Parallel layouts of the MoE layer: device meshes, virtual-padding metadata, styles.

See ``docs/parallelism.md``.
"""

from dtensor_moe.parallel.mesh import MoEMeshes, build_moe_meshes
from dtensor_moe.parallel.padding import ShardDim, TokenShardMeta

__all__ = [
    "MoEMeshes",
    "ShardDim",
    "TokenShardMeta",
    "build_moe_meshes",
]
