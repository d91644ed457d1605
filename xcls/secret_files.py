"""Reading the files that hold secrets (auth token, TLS key and certificates)."""

from __future__ import annotations

from pathlib import Path

from xcls.config import ConfigError


def read_secret(path: str | Path, what: str) -> bytes:
    """The bytes of ``path``; ConfigError naming ``what`` (the flag or config key that gave the
    path) when it cannot be read or is empty. ``xcls`` prints it as one line, exit code 2."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror}") from None
    if not data.strip():
        raise ConfigError(f"{what}: {path} is empty")
    return data
