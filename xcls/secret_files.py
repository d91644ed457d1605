"""Reading the files that hold secrets (auth token, TLS key and certificates)."""

from __future__ import annotations

from pathlib import Path

from xcls.config import ConfigError

# A token, a key or a certificate chain is a few KiB; the bound keeps a wrong path
# (/dev/zero, a dataset) from being read whole.
MAX_SECRET_BYTES = 1 << 20


def read_secret(path: str | Path, what: str) -> bytes:
    """The bytes of ``path``; ConfigError naming ``what`` (the flag or config key that gave the
    path) when it cannot be read, is empty or is larger than ``MAX_SECRET_BYTES``. ``xcls``
    prints it as one line, exit code 2."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise ConfigError(f"{what}: {path} holds more than {MAX_SECRET_BYTES} bytes, not a "
                          "secret")
    if not data.strip():
        raise ConfigError(f"{what}: {path} is empty")
    return data
