"""How a shard's requests travel: what both ends of a connection agree on.

``frames`` is the data plane's binary frame format (pure; ``proto/ams/api/frames.md``),
``codec`` converts tensors and table specs to and from the control plane's protobuf messages,
``pieces`` cuts a push into the requests one shard's part travels in, ``status`` maps typed
errors to gRPC status codes and back, and ``limits`` holds the message limits, piece sizes and
metadata keys both ends use.
"""
