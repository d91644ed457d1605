"""Addresses of shards and schedulers as users write them: ``host:port``, ``[v6]:port``."""

from __future__ import annotations

from ams.errors import InvalidArgument


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` (``[v6]:port`` for IPv6); InvalidArgument otherwise."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"address {address[:80]!r}: expected host:port with a port in "
                              "1..65535")
    return host, int(port)
