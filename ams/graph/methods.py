"""The ways a graph is built and kept current: values of the ``graph.method`` and
``graph.refresh`` settings, carried out by ``ams.graph.build``."""

from __future__ import annotations

from enum import StrEnum


class GraphMethod(StrEnum):
    """How a full build finds each class's neighbors."""

    EXACT = "exact"  # every pair of rows scored (ams.graph.knn, ring.py): O(N^2 d)
    IVF = "ivf"  # faiss inverted lists over float16 rows (ams.graph.ivf): about O(N^1.5 d)


class GraphRefresh(StrEnum):
    """What a rebuild during training recomputes (``ams.graph.build.GraphUpdater``)."""

    FULL = "full"  # every class's list, every time
    TOUCHED = "touched"  # after a full build, only the lists of the classes pushed since
