"""Gear bridge: the dense-feature cache (memory / LMDB / Redis, with expiry), the per-sample
gradient accumulation that feeds the slow gear, and the versioned weight store that carries the
backbone back to the fast gears; :mod:`bridge.protocols` holds the contracts gear mode uses. See
docs/architecture.md, "One gear step"."""

from bridge.accumulator import EntryHandle, GradientBatch, MemoryGradientAccumulator
from bridge.cache import FeatureCacheBase
from bridge.errors import BridgeError, CorruptEntryError, MalformedGradientError
from bridge.lmdb_cache import LmdbFeatureCache
from bridge.memory_cache import MemoryFeatureCache
from bridge.metrics import AccumulatorMetrics, CacheMetrics
from bridge.protocols import (
    CheckpointState,
    FeatureCache,
    GearBackend,
    GradientSink,
    GradientSource,
    WeightChannel,
)
from bridge.redis_accumulator import RedisGradientAccumulator, RedisGradientConsumer
from bridge.redis_cache import RedisFeatureCache
from bridge.redis_util import make_client
from bridge.weight_store import WeightStore, weights_digest

__all__ = [
    "AccumulatorMetrics", "BridgeError", "CacheMetrics", "CheckpointState", "CorruptEntryError",
    "EntryHandle", "FeatureCache", "FeatureCacheBase", "GearBackend", "GradientBatch",
    "GradientSink", "GradientSource", "LmdbFeatureCache", "MalformedGradientError",
    "MemoryFeatureCache", "MemoryGradientAccumulator", "RedisFeatureCache",
    "RedisGradientAccumulator", "RedisGradientConsumer", "WeightChannel", "WeightStore",
    "make_client", "weights_digest",
]
