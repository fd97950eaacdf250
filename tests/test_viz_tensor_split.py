"""The MLP split drawing: the per-rank slices tile the full weights exactly, the figure draws one colour per
rank, bad sizes are named."""

from __future__ import annotations

import pytest
import torch

from workbench.viz.tensor_split import RANK_COLOURS, REPLICATED, mlp_split_figure, mlp_split_shapes


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_slices_tile_the_full_weights_once(tp: int) -> None:
    d, hidden = 8, 32
    fc, proj = torch.zeros(hidden, d), torch.zeros(d, hidden)
    for rank in mlp_split_shapes(d, hidden, tp):
        (r0, r1), (c0, c1) = rank["mlp.fc.weight"]["rows"], rank["mlp.proj.weight"]["cols"]
        fc[r0:r1] += 1
        proj[:, c0:c1] += 1
        assert tuple(fc[r0:r1].shape) == rank["mlp.fc.weight"]["shape"]
        assert tuple(proj[:, c0:c1].shape) == rank["mlp.proj.weight"]["shape"]
        assert rank["mlp.proj.bias"]["shape"] == (d,)  # added once, after g: whole on every rank
    assert torch.equal(fc, torch.ones_like(fc)) and torch.equal(proj, torch.ones_like(proj))


def test_figure_colours_each_rank_and_the_replicated_tensors() -> None:
    fig = mlp_split_figure(8, 32, 4, 6)
    fills = {shape.fillcolor for shape in fig.layout.shapes}
    assert set(RANK_COLOURS[:4]) | {REPLICATED} <= fills
    assert [t.name for t in fig.data if t.name][:4] == [f"rank {r}" for r in range(4)]


@pytest.mark.parametrize("args, message", [((8, 30, 4), "hidden width 30 is not divisible by tp=4"),
                                           ((8, 32, 0), "tp must be a positive int")])
def test_bad_sizes_are_named(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mlp_split_shapes(*args)
