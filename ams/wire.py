"""Limits both ends of a gRPC channel agree on."""

from __future__ import annotations

# gRPC's 4 MiB default breaks replies above ~8k fp32 rows of d=128. Both ends allow 256 MiB;
# the client splits requests so that one message stays under REQUEST_BYTES.
MAX_MESSAGE_BYTES = 256 << 20
REQUEST_BYTES = 32 << 20
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
