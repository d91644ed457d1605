"""TakeTouched and the ivf graph build over real shard processes and the command line."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import ams
from ams.errors import InvalidArgument

N, D, K = 900, 8, 8


def test_take_touched_over_grpc(shard_cluster):
    procs = shard_cluster(2)
    client = ams.connect(",".join(p.address for p in procs))
    client.create_table("fc", num_rows=N, dim=D)
    assert client.take_touched("fc").tolist() == []
    client.push("fc", torch.tensor([10, 3, 3, 898, 7]), torch.ones(5, D), lr=0.1)
    bad = torch.ones(2, D)
    bad[0, 1] = float("inf")
    with pytest.raises(InvalidArgument):
        client.push("fc", torch.tensor([20, 22]), bad, lr=0.1)  # one shard refuses it whole
    assert client.take_touched("fc").tolist() == [3, 7, 10, 898]
    assert client.take_touched("fc").tolist() == []
    client.push("fc", torch.arange(6), torch.ones(6, D), lr=0.1)
    assert client.take_touched("fc", shards=[0]).tolist() == [0, 2, 4]
    assert client.take_touched("fc").tolist() == [1, 3, 5]
    client.close()


def test_cli_ivf_build_and_unknown_method(shard_cluster):
    procs = shard_cluster(2)
    addresses = ",".join(p.address for p in procs)
    client = ams.connect(addresses)
    client.create_table("fc", num_rows=N, dim=D, seed=4)
    base = [sys.executable, "-m", "xcls", "graph", "build", "--ams", addresses, "--table", "fc",
            "--k", str(K)]
    out = subprocess.run([*base, "--method", "hnsw"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --method 'hnsw' is not one of 'exact', 'ivf'"]

    out = subprocess.run([*base, "--method", "ivf", "--nlist", "6", "--nprobe", "6"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "graph version 1" in out.stdout
    found = re.search(rf"recall@{K} ([0-9.]+) on {N} sampled classes", out.stdout)
    assert found and float(found.group(1)) >= 0.99, out.stdout  # exhaustive: fp16 ties only
    lists = client.neighbors("fc", torch.arange(N)).numpy()
    x = client.pull("fc", torch.arange(N)).double().numpy()
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    scores = x @ x.T
    kth = -np.sort(-scores, axis=1)[:, K - 1]
    assert (lists[:, 0] == np.arange(N)).all()
    for i in range(N):  # every list scanned (nprobe = nlist): the true top-k up to fp16 ties
        assert (scores[i, lists[i]] >= kth[i] - 2.0**-9).all()
    client.close()
