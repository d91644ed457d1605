"""KNN graph over class-weight rows: exact blocked build, ring schedule over shards, CSR
neighbor table, active-class selection. Pure torch: no gRPC, no ``ams.api``."""

from ams.graph.churn import neighbor_turnover
from ams.graph.csr import NeighborTable, csr_to_dense, gather_segments
from ams.graph.knn import (
    LOW_PRECISION_DTYPE,
    LOW_PRECISION_MARGIN,
    KeyBlock,
    ScoreBuffer,
    TopKAccumulator,
    knn,
    resolve_device,
    resolve_low_precision,
    search_pass,
    symmetric_search,
)
from ams.graph.ring import assign_shards, build_shard_neighbors, refresh_neighbors, ring_order
from ams.graph.select import budget_for_sample_rate, select_active, select_partial

__all__ = [
    "LOW_PRECISION_DTYPE",
    "LOW_PRECISION_MARGIN",
    "KeyBlock",
    "NeighborTable",
    "ScoreBuffer",
    "TopKAccumulator",
    "assign_shards",
    "budget_for_sample_rate",
    "build_shard_neighbors",
    "csr_to_dense",
    "gather_segments",
    "knn",
    "neighbor_turnover",
    "refresh_neighbors",
    "resolve_device",
    "resolve_low_precision",
    "ring_order",
    "search_pass",
    "select_active",
    "select_partial",
    "symmetric_search",
]
