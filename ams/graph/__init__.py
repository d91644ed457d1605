"""The neighbors graph over the class rows: which classes each class is nearest to.

The algorithms are pure torch (no gRPC, no ``ams.api``): the exact blocked top-k (``knn``, its
streaming core ``topk``, and on CUDA its fused score-and-filter kernel ``fused_filter``), the ring
schedule that streams every shard's rows past a builder's queries (``ring``), the approximate build
with a faiss IVF index (``ivf``, faiss imported when used), the build methods and refresh kinds
(``methods``), and the lists' turnover between builds (``churn``). ``build`` is the job above them:
it builds or refreshes a table's graph through the AMS client's public calls and writes each class's
list back to the shard that owns it (``ams.shard.neighbor_lists`` keeps them there)."""

from ams.graph.churn import neighbor_turnover
from ams.graph.ivf import IvfIndex, ivf_knn, list_recall, resolve_nlist, sample_ids
from ams.graph.knn import knn, search_pass, symmetric_search
from ams.graph.methods import GraphMethod, GraphRefresh
from ams.graph.ring import assign_shards, build_shard_neighbors, refresh_neighbors, ring_order
from ams.graph.topk import (
    LOW_PRECISION_DTYPE,
    LOW_PRECISION_MARGIN,
    KeyBlock,
    ScoreBuffer,
    TopKAccumulator,
    resolve_block_rows,
    resolve_device,
    resolve_low_precision,
)

__all__ = [
    "GraphMethod",
    "GraphRefresh",
    "LOW_PRECISION_DTYPE",
    "LOW_PRECISION_MARGIN",
    "IvfIndex",
    "KeyBlock",
    "ScoreBuffer",
    "TopKAccumulator",
    "assign_shards",
    "build_shard_neighbors",
    "ivf_knn",
    "knn",
    "list_recall",
    "neighbor_turnover",
    "refresh_neighbors",
    "resolve_block_rows",
    "resolve_device",
    "resolve_low_precision",
    "resolve_nlist",
    "ring_order",
    "sample_ids",
    "search_pass",
    "symmetric_search",
]
