"""The shard server process: its gRPC control plane (``servicer``: decode, call the store,
encode), the interceptors every call passes (token, incarnation, readiness, request decoding,
metrics; ``interceptors``), and ``create_server``, which serves a store on both planes with
health checks (``service``).
"""
