"""KNN graph over class-weight rows: exact blocked build, ring schedule over shards, IVF build
(faiss, imported when used), compact neighbor table (fixed width or CSR), active-class
selection. Pure: no gRPC, no ``ams.api``."""

from ams.graph.churn import neighbor_turnover
from ams.graph.csr import (
    NeighborTable,
    check_lists,
    gather_segments,
    id_dtype,
    lists_to_dense,
)
from ams.graph.ivf import IvfIndex, ivf_knn, list_recall, resolve_nlist, sample_ids
from ams.graph.knn import (
    LOW_PRECISION_DTYPE,
    LOW_PRECISION_MARGIN,
    KeyBlock,
    ScoreBuffer,
    TopKAccumulator,
    knn,
    resolve_block_rows,
    resolve_device,
    resolve_low_precision,
    search_pass,
    symmetric_search,
)
from ams.graph.methods import GraphMethod, GraphRefresh
from ams.graph.ring import assign_shards, build_shard_neighbors, refresh_neighbors, ring_order
from ams.graph.select import budget_for_sample_rate, select_active, select_partial

__all__ = [
    "GraphMethod",
    "GraphRefresh",
    "LOW_PRECISION_DTYPE",
    "LOW_PRECISION_MARGIN",
    "IvfIndex",
    "KeyBlock",
    "NeighborTable",
    "ScoreBuffer",
    "TopKAccumulator",
    "assign_shards",
    "budget_for_sample_rate",
    "build_shard_neighbors",
    "check_lists",
    "gather_segments",
    "id_dtype",
    "ivf_knn",
    "knn",
    "list_recall",
    "lists_to_dense",
    "neighbor_turnover",
    "refresh_neighbors",
    "resolve_block_rows",
    "resolve_device",
    "resolve_low_precision",
    "resolve_nlist",
    "ring_order",
    "sample_ids",
    "search_pass",
    "select_active",
    "select_partial",
    "symmetric_search",
]
