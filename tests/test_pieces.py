"""A push cut into pieces (ams/wire/pieces.py), checked against plain indexing."""

from __future__ import annotations

import pytest
import torch

from ams.shard.rowcopy import ascending_unique
from ams.wire.pieces import PushPieces, piece_sizes


@pytest.mark.parametrize("rows, most", [(0, 4), (1, 4), (4, 4), (5, 4), (10_000, 4096),
                                        (8193, 4096), (7, 1), (3, 0)])
def test_piece_sizes_cover_the_rows_in_as_few_even_pieces_as_they_take(rows, most):
    sizes = piece_sizes(rows, most)
    assert sum(sizes) == rows
    assert len(sizes) == max(1, -(-rows // max(1, most)))
    assert max(sizes) - min(sizes) <= 1
    assert max(sizes) <= max(1, most) or rows == 0


@pytest.mark.parametrize("permuted", [False, True])
def test_pieces_carry_each_keys_gradient_whether_gathered_into_a_buffer_or_not(permuted):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randperm(1000, generator=gen)[:300].sort().values
    values = torch.randn(300, 8, generator=gen)
    source = torch.randperm(300, generator=gen) if permuted else None
    sizes = piece_sizes(300, 128)
    chunks = torch.arange(300).split(sizes)
    pieces = PushPieces(keys, values, source, sizes, first_sequence=41)
    for i, chunk in enumerate(chunks):
        expected_rows = values[source[chunk]] if permuted else values[chunk]
        buffer = torch.full((pieces.rows_of(i) + 2, pieces.dim), float("nan"))
        for got in (pieces[i], pieces.gather(i, out=buffer[1:-1])):
            assert torch.equal(got.ids, keys[chunk])
            assert torch.equal(got.grads, expected_rows)
            assert got.sequence == 41 + i
        assert buffer[0].isnan().all() and buffer[-1].isnan().all()  # nothing outside ``out``
    assert [len(pieces), pieces.rows_of(0)] == [3, 100]
    assert [piece.sequence for piece in pieces] == [41, 42, 43]  # iteration ends after the last


def test_one_piece_is_the_given_push():
    ids, grads = torch.tensor([2, 5, 9]), torch.arange(6.0).view(3, 2)
    (piece,) = PushPieces.one(ids, grads, 7)
    assert torch.equal(piece.ids, ids) and torch.equal(piece.grads, grads)
    assert piece.sequence == 7


def _summed(ids: list[int], grads: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each id's gradient, repeats summed in float64: the reference."""
    total: dict[int, torch.Tensor] = {}
    for i, key in enumerate(ids):
        total[key] = total.get(key, torch.zeros(grads.shape[1], dtype=torch.float64)) \
            + grads[i].double()
    return total


@pytest.mark.parametrize("order", ["ascending", "shuffled", "repeats"])
@pytest.mark.parametrize("owned", ["all", "even"])
def test_a_shards_part_is_its_ids_ascending_once_with_their_summed_gradients(order, owned):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(5000, generator=gen)[:400]
    if order == "ascending":
        ids = ids.sort().values
    elif order == "repeats":
        ids = torch.cat([ids, ids[:150], ids[:20]])[torch.randperm(570, generator=gen)]
    grads = torch.randn(ids.numel(), 6, generator=gen)
    positions = None if owned == "all" else (ids % 2 == 0).nonzero().view(-1)
    mine = list(range(ids.numel())) if positions is None else positions.tolist()
    expected = _summed([int(ids[i]) for i in mine], grads[mine])

    keys, values, source = ascending_unique(ids, grads, positions)
    assert keys.tolist() == sorted(expected)
    rows = values if source is None else values[source]
    for key, row in zip(keys.tolist(), rows, strict=True):
        assert torch.allclose(row.double(), expected[key], atol=1e-6)
    if order == "ascending" and owned == "all":
        assert keys is ids and values is grads  # nothing sorted, nothing copied


def test_a_repeated_ids_gradients_are_summed_in_request_order():
    """float32 addition is not associative: a repeated id's sum must not depend on the sort's
    order among equal keys, or on which other ids share its shard. Against sums taken one
    value at a time in request order."""
    n = 64
    ids = torch.tensor([7, 3] * (n // 2))
    g = torch.Generator().manual_seed(2)
    # magnitudes from 1e-4 to 1e4: another order of the additions rounds differently
    grads = (torch.randn(n, 3, generator=g) * torch.logspace(-4, 4, n)[:, None]).float()
    for positions in (None, torch.arange(n), torch.arange(0, n, 2)):
        rows = torch.arange(n) if positions is None else positions
        want: dict[int, torch.Tensor] = {}
        for i in rows.tolist():
            key = int(ids[i])
            want[key] = want[key] + grads[i] if key in want else grads[i].clone()
        keys, values, source = ascending_unique(ids, grads, positions)
        assert source is None and keys.tolist() == sorted(want)
        for key, row in zip(keys.tolist(), values, strict=True):
            assert torch.equal(row, want[key]), key
