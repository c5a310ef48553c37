"""The rank lists of the 2D grid and the 3D cube (pure arithmetic, no torch)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from optimus_mllm.runtime.tp_modes.layout import cube_layout, grid_layout


def test_grid_rows_are_contiguous_and_columns_strided() -> None:
    grid = grid_layout((10, 11, 12, 13, 14, 15, 16, 17, 18))
    assert grid.q == 3
    assert grid.rows == ((10, 11, 12), (13, 14, 15), (16, 17, 18))
    assert grid.columns == ((10, 13, 16), (11, 14, 17), (12, 15, 18))
    assert grid.rank(1, 2) == 15 and grid.coords(15) == (1, 2)


def test_every_grid_rank_is_in_one_row_and_one_column() -> None:
    grid = grid_layout(tuple(range(16)))
    for rank in range(16):
        i, j = grid.coords(rank)
        assert [rank in row for row in grid.rows].count(True) == 1
        assert rank in grid.rows[i] and rank in grid.columns[j]


def test_cube_lines_follow_the_paper_directions() -> None:
    """x varies i, y varies j, z varies l; y runs fastest, then z: a y-z plane is p^2 ranks."""
    cube = cube_layout(tuple(range(8)))
    assert cube.p == 2
    for i, j, l in itertools.product(range(2), repeat=3):  # noqa: E741
        rank = cube.rank(i, j, l)
        assert cube.coords(rank) == (i, j, l)
        assert rank == (i * 2 + l) * 2 + j
    assert cube.y == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert cube.z == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert cube.x == ((0, 4), (2, 6), (1, 5), (3, 7))
    for lines in (cube.x, cube.y, cube.z):
        assert sorted(r for line in lines for r in line) == list(range(8))
    # both activation directions stay inside the first p^2 ranks (a node of 4 GPUs)
    assert {r for line in cube.y + cube.z if 0 in line for r in line} <= {0, 1, 2, 3}


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_a_grid_needs_a_square(n: int) -> None:
    with pytest.raises(ValueError, match="square number of ranks"):
        grid_layout(tuple(range(n)))


def test_a_cube_needs_a_cube_and_distinct_ranks() -> None:
    with pytest.raises(ValueError, match="cube number of ranks"):
        cube_layout(tuple(range(9)))
    with pytest.raises(ValueError, match="ranks repeat"):
        grid_layout((0, 1, 1, 2))


def test_layout_and_footprint_import_no_torch() -> None:
    """The planner and memory model (no torch) will compute grids and bytes with them."""
    code = (
        "import sys, optimus_mllm.runtime.tp_modes.layout, optimus_mllm.costing.tp_footprint,"
        " optimus_mllm.costing.tp_memory; print('torch' in sys.modules)"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )
