"""Flat slices as rectangular checkpoint pieces (one process, no world).

Localizes the geometry (``flat_range_boxes``: every flat range of every small shape is
covered exactly, in order, by at most 2·ndim − 1 contiguous boxes, checked against a mask
built from the range itself) and ``CheckpointPieces`` under torch.distributed.checkpoint in
one process: pieces are views (a load writes the slice's memory), a save of pieces reads
back whole, and a load into pieces of another split reads the overlapping parts. Values are
copied bytes: every comparison is exact.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from mc_ddp.checkpoint_pieces import Box, CheckpointPieces, flat_range_boxes, pieces_of_flat_slice


@st.composite
def _shape_and_range(draw: st.DrawFn) -> tuple[list[int], int, int]:
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    numel = math.prod(shape)
    start = draw(st.integers(0, numel))
    return shape, start, draw(st.integers(start, numel))


@settings(max_examples=300, deadline=None)
@given(_shape_and_range())
def test_boxes_cover_the_flat_range_exactly(case: tuple[list[int], int, int]) -> None:
    shape, start, end = case
    boxes = flat_range_boxes(shape, start, end)
    assert len(boxes) <= 2 * len(shape) - 1
    covered = torch.zeros(shape, dtype=torch.int64)
    position = start
    for box in boxes:
        assert box.flat_start == position  # in flat order, no gaps
        region = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
        covered[region] += 1
        flat_ids = torch.arange(math.prod(shape)).view(shape)[region].reshape(-1)
        assert torch.equal(flat_ids, torch.arange(position, position + flat_ids.numel()))
        position += flat_ids.numel()
    assert position == end
    expected = torch.zeros(math.prod(shape), dtype=torch.int64)
    expected[start:end] = 1
    assert torch.equal(covered.view(-1), expected)  # each element once, nothing outside


def test_the_documented_example() -> None:
    # [4, 5], elements 7..17: the rest of row 1 (cols 2-4), row 2, row 3's first 3 cols
    assert flat_range_boxes([4, 5], 7, 18) == [
        Box(7, (1, 2), (1, 3)),
        Box(10, (2, 0), (1, 5)),
        Box(15, (3, 0), (1, 3)),
    ]
    assert flat_range_boxes([4, 5], 5, 20) == [Box(5, (1, 0), (3, 5))]  # whole rows: one box
    assert flat_range_boxes([4, 5], 3, 3) == []


@pytest.mark.parametrize(
    ("shape", "start", "end", "needle"),
    [
        ([], 0, 0, "shape=() must have at least one dim"),
        ([3, 0], 0, 0, "shape=(3, 0)"),
        ([2, 3], 4, 2, "[start=4, end=2)"),
        ([2, 3], 0, 7, "numel=6"),
        ([2, 3], -1, 2, "[start=-1, end=2)"),
    ],
)
def test_bad_ranges_are_refused(shape: list[int], start: int, end: int, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        flat_range_boxes(shape, start, end)
    assert needle in str(err.value)


def test_pieces_are_views_and_refuse_tensor_math() -> None:
    flat = torch.arange(3.0, 14.0)  # elements 3..13 of a [3, 5] local tensor at rows 4..6
    pieces = pieces_of_flat_slice(flat, 3, (3, 5), (4, 0), (12, 5))
    assert tuple(pieces.shape) == (12, 5)
    offsets = [tuple(o) for o, _ in pieces.pieces]
    assert offsets == [(4, 3), (5, 0), (6, 0)]
    for _, piece in pieces.pieces:
        piece.fill_(-1.0)
    assert torch.equal(flat, torch.full((11,), -1.0))  # the pieces wrote the slice itself
    with pytest.raises(TypeError, match="CheckpointPieces"):
        _ = pieces + 1
    assert "CheckpointPieces(shape=(12, 5)" in repr(pieces)
    with pytest.raises(ValueError, match="2 pieces but 1 offsets"):
        CheckpointPieces((4,), [torch.zeros(1), torch.zeros(1)], [(0,)])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reads_pieces_back_at_any_split(tmp_path: Path) -> None:
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    path = str(tmp_path / "ckpt")
    whole = pieces_of_flat_slice(full.view(-1).clone(), 0, (6, 4), (0, 0), (6, 4))
    dcp_save({"w": whole, "step": torch.tensor(7.0)}, checkpoint_id=path, no_dist=True)
    # another split: elements 5..18 (row 1 from col 1, rows 2-3, row 4 up to col 2)
    part = torch.zeros(14)
    other = pieces_of_flat_slice(part, 5, (6, 4), (0, 0), (6, 4))
    step = torch.tensor(0.0)
    dcp_load({"w": other, "step": step}, checkpoint_id=path, no_dist=True)
    assert torch.equal(part, full.view(-1)[5:19])
    assert float(step) == 7.0
    back = torch.zeros(6, 4)
    dcp_load({"w": back}, checkpoint_id=path, no_dist=True)
    assert torch.equal(back, full)
