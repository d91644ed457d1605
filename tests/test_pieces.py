"""A push cut into pieces (ams/pieces.py), checked against plain indexing."""

from __future__ import annotations

import pytest
import torch

from ams.pieces import PushPieces, piece_sizes


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
    chunks = torch.arange(300).split(piece_sizes(300, 128))
    pieces = PushPieces(keys, values, source, chunks, first_sequence=41)
    for i, chunk in enumerate(chunks):
        expected_rows = values[source[chunk]] if permuted else values[chunk]
        buffer = torch.full((pieces.rows_of(i) + 2, pieces.dim), float("nan"))
        for got in (pieces[i], pieces.gather(i, out=buffer[1:-1])):
            assert torch.equal(got.ids, keys[chunk])
            assert torch.equal(got.grads, expected_rows)
            assert got.sequence == 41 + i
        assert buffer[0].isnan().all() and buffer[-1].isnan().all()  # nothing outside ``out``
    assert [len(pieces), pieces.rows_of(0)] == [3, 100]


def test_one_piece_is_the_given_push():
    ids, grads = torch.tensor([2, 5, 9]), torch.arange(6.0).view(3, 2)
    (piece,) = PushPieces.one(ids, grads, 7)
    assert torch.equal(piece.ids, ids) and torch.equal(piece.grads, grads)
    assert piece.sequence == 7
