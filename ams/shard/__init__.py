"""One shard's state, pure torch (no gRPC): the class rows of the ids it owns, their optimizer
state and decay clocks, and the classes' neighbor lists.

``store`` is the shard's API (create, pull, push, scan, neighbor lists), validating every
request before it changes anything. Below it: the tables' specs (``spec``), where their
tensors live, in memory or in mapped files (``storage``, ``mapped``, with the OS page advice
in ``page_advice`` and the mapped rows' slots in ``slots``), the row update and its compiled
kernel (``optim``, ``_kernels.c``), the rows' initial values (``rowinit``), the neighbor lists
(``neighbor_lists``), LMDB snapshots and their restore (``snapshot``, ``restore``), and the
shard process's Prometheus metrics (``metrics``). Rooms above (the wire, the two planes'
servers, the client) import this one; it imports none of them.
"""
