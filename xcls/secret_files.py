"""Reading the files that hold secrets (auth token, TLS key and certificates, a Redis
password)."""

from __future__ import annotations

import re
from pathlib import Path

from xcls.config import ConfigError

# A token, a key or a certificate chain is a few KiB; the bound keeps a wrong path
# (/dev/zero, a dataset) from being read whole.
MAX_SECRET_BYTES = 1 << 20
# What a gRPC metadata value may hold (printable ASCII and the space): the token travels as
# "authorization: Bearer <token>", and a client could send no other, so a shard or scheduler
# started with one would refuse every caller.
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")


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


def read_secret_text(path: str | Path, what: str) -> str:
    """``read_secret`` as UTF-8 text without the whitespace around it (a file written by an
    editor ends in a newline); ConfigError when it is not UTF-8."""
    data = read_secret(path, what)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what}: {path} is not UTF-8 text (at byte {e.start})") from None


def read_token(path: str | Path, what: str) -> str:
    """The shared auth token in ``path`` (``read_secret_text``); ConfigError when it holds a
    character a gRPC metadata value cannot carry: a line break inside it, a control character
    or anything outside ASCII."""
    token = read_secret_text(path, what)
    at = _METADATA_VALUE.match(token).end()
    if at < len(token):  # the character itself is not shown: it is part of the secret
        char = token[at]
        kind = "a line break" if char in "\r\n" else \
            "a non-ASCII character" if ord(char) > 0x7F else "a control character"
        raise ConfigError(f"{what}: {path} holds {kind} at character {at} of the token; a "
                          "token is one line of printable ASCII (it travels as gRPC metadata)")
    return token
