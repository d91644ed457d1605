"""Backbone weights in Redis, versioned: the :class:`bridge.protocols.WeightChannel` from an
external slow gear (``xcls gear slow``, which publishes every few backbone steps) to the fast
gears (which reload the newest every few steps).

``{prefix}:weights`` holds a header (magic, version, sha256 of the payload) and ``torch.save`` of
the state dict; ``{prefix}:weights:version`` the version alone, so a fast worker polls one small
key and fetches the blob only when it changed. Both are written in one MULTI. A blob that fails
its checks (magic, checksum, keys/shapes of the model) is logged and ignored, and an unreachable
Redis answers "nothing new": the fast gear keeps the weights it has.

The trainers own the job's timeline: when they start or roll back to a checkpoint, their rank 0
:meth:`WeightStore.reset` s the channel to the checkpoint's backbone, at a version above every
one published before (so no mean of the discarded steps can pass for one of the new steps). The
slow gear publishes with ``replaces=`` the version it started from, which fails once a reset came
in between; it then loads the reset weights and goes on from them.
"""

from __future__ import annotations

import hashlib
import io
import logging
import struct

import redis
import torch
from torch import nn

from bridge.errors import BridgeError
from bridge.ratelimit import RateLimitedLog
from bridge.redis_util import RedisGuard

log = logging.getLogger(__name__)

_WEIGHTS_HEADER = struct.Struct("<4sq32s")  # magic, version, sha256 of the payload
# Tries of a transaction on the version key that another publisher keeps moving: the slow gear
# and a trainer's reset are the only writers, so a few always suffice.
WATCH_ATTEMPTS = 8
_WEIGHTS_MAGIC = b"XGW1"


def weights_digest(module: nn.Module) -> str:
    """A short sha256 of ``module``'s parameters and buffers (its state dict, in order): equal
    digests mean bit-identical weights, e.g. across the ranks of a slow-gear group or between
    a publisher and a loader."""
    h = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class WeightStore:
    """Backbone weights of job ``prefix`` in Redis over ``client``
    (:func:`bridge.redis_util.make_client`); after a failure no call touches the network for
    ``bridge.redis_util.RETRY_AFTER_S``."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.key = f"{prefix}:weights".encode()
        self.version_key = f"{prefix}:weights:version".encode()
        self.guard = RedisGuard(f"weights:{prefix}")
        self._warn = RateLimitedLog(log)

    def publish(self, model: nn.Module, version: int, replaces: int | None = None) -> bool:
        """Store ``model``'s state dict as ``version``. With ``replaces``, only if the published
        version is still that one (-1: none yet), so a :meth:`reset` in between is never
        overwritten. False if Redis is unreachable or the published version moved."""
        blob = self._blob(self._payload(model), version)
        if not self.guard.usable():
            return False
        try:
            with self.client.pipeline(transaction=True) as pipe:
                if replaces is not None:
                    pipe.watch(self.version_key)
                    if self._version_in(pipe) != replaces:
                        return False
                    pipe.multi()
                pipe.set(self.key, blob)
                pipe.set(self.version_key, str(version).encode())
                pipe.execute()
        except redis.WatchError:
            # The version moved, or the answer was lost (redis-py reports a connection lost
            # or timed out in a watched transaction so): the blob's header, which names this
            # version and payload digest, says whether it landed.
            return self._landed(blob)
        except redis.RedisError as e:
            self.guard.failed("publish", e)
            return False
        self.guard.ok()
        return True

    def _landed(self, blob: bytes) -> bool:
        """Whether the published blob is ``blob`` (by its header), for good: the read is a
        transaction that rewrites the version key as it is, so a publication still on its way
        (its EXEC held up in the network or in Redis) fails its WATCH instead of landing after
        the answer. False when Redis cannot say."""
        for _ in range(WATCH_ATTEMPTS):
            try:
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.watch(self.version_key)
                    head = pipe.getrange(self.key, 0, _WEIGHTS_HEADER.size - 1)
                    current = pipe.get(self.version_key)
                    pipe.multi()
                    # SET touches the key for every WATCH on it (DEL of a missing key would not)
                    pipe.set(self.version_key, current if current is not None else b"")
                    if current is None:
                        pipe.delete(self.version_key)
                    pipe.execute()
            except redis.WatchError:
                continue
            except redis.RedisError as e:
                self.guard.failed("publish", e)
                return False
            self.guard.ok()
            return head == blob[:_WEIGHTS_HEADER.size]
        return False

    def reset(self, model: nn.Module, version: int) -> int:
        """Publish ``model`` as the start of a new timeline of the job (a fresh start or a
        rollback), at ``version`` or, if a version at or above it was published before, one
        above that. Returns the version it was published as; raises BridgeError if Redis
        cannot be reached (training on would mix the discarded steps into the new ones)."""
        payload = self._payload(model)
        for _ in range(WATCH_ATTEMPTS):
            try:
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.watch(self.version_key)
                    version = max(version, self._version_in(pipe) + 1)
                    blob = self._blob(payload, version)
                    pipe.multi()
                    pipe.set(self.key, blob)
                    pipe.set(self.version_key, str(version).encode())
                    pipe.execute()
            except redis.WatchError:
                continue
            except redis.RedisError as e:
                raise BridgeError(f"cannot reset the job's published weights in Redis ({e})") \
                    from e
            log.info("gear_weights_reset version=%d", version)
            return version
        raise BridgeError("cannot reset the job's published weights: the version kept changing")

    def _version_in(self, pipe: redis.client.Pipeline) -> int:
        """The published version read through a watching pipeline; -1 when none, or garbage."""
        raw = pipe.get(self.version_key)
        try:
            return int(raw) if raw is not None else -1
        except ValueError:
            return -1

    @staticmethod
    def _payload(model: nn.Module) -> bytes:
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
        return buf.getvalue()

    @staticmethod
    def _blob(payload: bytes, version: int) -> bytes:
        return _WEIGHTS_HEADER.pack(_WEIGHTS_MAGIC, version,
                                    hashlib.sha256(payload).digest()) + payload

    def published_version(self) -> int | None:
        """The newest published version, None if none (or Redis is down, or it is garbage)."""
        if not self.guard.usable():
            return None
        try:
            raw = self.client.get(self.version_key)
        except redis.RedisError as e:
            self.guard.failed("version", e)
            return None
        self.guard.ok()
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            self._warn.warn("gear_weights_bad_version", value=repr(raw[:32]))
            return None

    def load_into(self, model: nn.Module, newer_than: int) -> int | None:
        """Load the published weights into ``model`` if their version > ``newer_than``.
        Returns the loaded version, or None (nothing newer, unreachable or rejected)."""
        version = self.published_version()
        if version is None or version <= newer_than:
            return None
        try:
            blob = self.client.get(self.key)
        except redis.RedisError as e:
            self.guard.failed("fetch", e)
            return None
        try:
            state, version = self._decode(blob, model)
        except ValueError as e:
            self._warn.warn("gear_weights_rejected", error=repr(str(e)))
            return None
        model.load_state_dict(state)
        return version

    @staticmethod
    def _decode(blob: bytes | None, model: nn.Module) -> tuple[dict, int]:
        if blob is None or len(blob) < _WEIGHTS_HEADER.size:
            raise ValueError("weights blob missing or truncated")
        magic, version, digest = _WEIGHTS_HEADER.unpack_from(blob)
        payload = blob[_WEIGHTS_HEADER.size:]
        if magic != _WEIGHTS_MAGIC or hashlib.sha256(payload).digest() != digest:
            raise ValueError(f"weights blob fails its magic/checksum (magic {magic!r})")
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as e:  # torch.load raises many types on bad pickles
            raise ValueError(f"weights payload does not load: {e}") from e
        own = model.state_dict()
        if not isinstance(state, dict) or state.keys() != own.keys() or any(
                not isinstance(state[k], torch.Tensor) or state[k].shape != own[k].shape
                for k in own):
            raise ValueError("published weights do not match this backbone's parameters")
        return state, version
