"""The AMS client API: one object over all shards, local or remote.

``ShardedClient`` (``sharded``) routes ids to their shards, fans out in parallel and reassembles
replies in request order; it talks to each shard through one backend protocol (``backend``),
served by ``RemoteShard`` (gRPC and the data plane, ``remote``) or ``LocalShard`` (a store in
this process, ``local``). ``connect`` (``connect``) builds a client; ``retry`` is the one retry
rule every remote call follows.

    client = ams.connect(["127.0.0.1:7001", "127.0.0.1:7002"])
    client.create_table("fc", num_rows=1_000_000, dim=128)
    rows = client.pull("fc", ids)                      # (n, 128), in the order of ids
    client.push("fc", ids, grads, lr=0.1)              # the shards apply the update
"""
