"""The data plane: pulls, pushes and scans as binary frames on a TCP port beside each shard's
gRPC port (``proto/ams/api/frames.md``).

``sockets`` reads and writes frames on a socket, ``server`` is the shard's end (a thread per
connection, requests answered in order), with ``answers`` what it answers to each request and
``admission`` what its peers may hold (connections not yet greeted, request bytes),
``connection`` the client's end (one greeted
connection, requests pipelined), ``placements`` where a pull's rows land (in frames, or written
by the shard into a buffer the client shares with it), and ``shm`` that shared buffer.
"""
