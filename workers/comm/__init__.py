"""Data-parallel communication of the backbone's gradients: exact top-k selection
(``topk``) and the layer-wise top-k DDP hook with error feedback (``TopkCompressor``)."""

from workers.comm.compression import CommCounters, Compression, TopkCompressor
from workers.comm.topk_selection import TopkMethod, topk

__all__ = ["CommCounters", "Compression", "TopkCompressor", "TopkMethod", "topk"]
