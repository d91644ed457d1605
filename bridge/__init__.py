"""Gear bridge: the dense-feature cache (memory / LMDB / Redis, with expiry) and the per-sample
gradient accumulation that feeds the slow gear. See ARCHITECTURE.md, "Gear mode"."""

from bridge.accumulator import EntryHandle, GradientBatch, MemoryGradientAccumulator
from bridge.cache import FeatureCache
from bridge.errors import BridgeError, CorruptEntryError, MalformedGradientError
from bridge.lmdb_cache import LmdbFeatureCache
from bridge.memory_cache import MemoryFeatureCache
from bridge.metrics import AccumulatorMetrics, CacheMetrics
from bridge.redis_accumulator import RedisGradientAccumulator, RedisGradientConsumer
from bridge.redis_cache import RedisFeatureCache
from bridge.redis_util import make_client

__all__ = [
    "AccumulatorMetrics", "BridgeError", "CacheMetrics", "CorruptEntryError", "EntryHandle",
    "FeatureCache", "GradientBatch", "LmdbFeatureCache", "MalformedGradientError",
    "MemoryFeatureCache", "MemoryGradientAccumulator", "RedisFeatureCache",
    "RedisGradientAccumulator", "RedisGradientConsumer", "make_client",
]
