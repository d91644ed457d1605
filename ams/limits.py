"""Limits both ends of a gRPC channel agree on. No gRPC import, so the store checks them too."""

from __future__ import annotations

# gRPC's 4 MiB default breaks replies above ~8k fp32 rows of d=128. Both ends allow 256 MiB;
# the client splits requests so that one message stays under REQUEST_BYTES.
MAX_MESSAGE_BYTES = 256 << 20
REQUEST_BYTES = 32 << 20
# Tensor bytes one reply may carry; the rest of MAX_MESSAGE_BYTES is left to the framing
# (field tags, shapes). A shard checks this before it builds a reply, not after.
MAX_REPLY_PAYLOAD_BYTES = MAX_MESSAGE_BYTES - (1 << 20)
# Ids one request may name (a shard refuses more before it reads the body); the client cuts
# pulls, pushes and neighbor lists into requests within it whatever their rows' bytes.
MAX_IDS_PER_REQUEST = 1 << 20
# The data plane (ams.dataplane) sends a pull or push in pieces of about this many bytes of
# rows, # PIPELINE_WINDOW of them on the wire at once: the shard applies one while the next arrives.
PIECE_BYTES = 2 << 20
PIPELINE_WINDOW = 2
# Pieces whose rows go through a shared buffer (ams.dataplane.shm) instead: they do not cross
# a socket, and each piece costs a round trip, so larger ones win (docs/decisions.md, "Piece
# sizes").
SHARED_PIECE_BYTES = 8 << 20
# The widest class row a table holds (ams.shard.spec); the config's model.dim is refused past it
# when it loads, before any table is asked for.
MAX_DIM = 1 << 16
# A shard's gRPC handler threads unless `xcls serve shard --rpc-threads` sets others (the planner,
# ams.cluster.plan, counts on this many): calls to one shard run in parallel up to it, and an
# idle thread costs only its stack.
RPC_THREADS = 16
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# The gRPC service name of a shard, under which its health is reported too.
SHARD_SERVICE_NAME = "xcls.ams.Shard"
# Call metadata: the shard process (incarnation) a reply comes from, and the one a caller
# expects; a shard refuses a call that expects another with ABORTED (ams.server.service).
INCARNATION_KEY = "xcls-incarnation"
EXPECT_INCARNATION_KEY = "xcls-expect-incarnation"
