"""The ``torch.distributed`` groups of a 2D grid (its rows and columns) and of a 3D cube (its
x, y and z lines), from ``layout``.

``torch.distributed.new_group`` must be called by every rank of the job, for every group, in the
same order, so the builders create every line of every direction on each rank and keep the ones
this rank belongs to. The groups are passed to the layers through their ``ModuleSpec``
params, never looked up from a global, so an encoder and an LLM may use different grids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from optimus_mllm.runtime.tp_modes.layout import (
    CubeLayout,
    GridLayout,
    Ranks,
    cube_layout,
    grid_layout,
)


@dataclass(frozen=True)
class Grid2D:
    """This rank's place on a q x q grid and the groups of its row and column."""

    layout: GridLayout
    row: int  # i: which block of tokens this rank holds
    column: int  # j: which block of the hidden (or head) dimension
    row_group: dist.ProcessGroup
    column_group: dist.ProcessGroup

    @property
    def q(self) -> int:
        return self.layout.q

    def rank(self, row: int, column: int) -> int:
        """The global rank at (``row``, ``column``), as the collectives' ``src`` / ``dst``."""
        return self.layout.rank(row, column)


def build_grid_groups(ranks: Ranks) -> Grid2D | None:
    """Create the row and column groups of the grid over ``ranks``; call on every rank of the job.

    Args:
        ranks: the grid's global ranks (q^2 of them); rows are contiguous runs of it.

    Returns:
        This rank's grid, or None on a rank outside ``ranks``.
    """
    layout = grid_layout(ranks)
    me = dist.get_rank()
    rows = [dist.new_group(list(members)) for members in layout.rows]
    columns = [dist.new_group(list(members)) for members in layout.columns]
    if me not in layout.ranks:
        return None
    i, j = layout.coords(me)
    return Grid2D(layout=layout, row=i, column=j, row_group=rows[i], column_group=columns[j])


def build_grids(groups: Sequence[Ranks]) -> Grid2D | None:
    """The grid of each of ``groups`` (built on every rank, in one order: ``new_group`` is
    collective); this rank's, or None when no group holds it."""
    mine = None
    for ranks in groups:
        grid = build_grid_groups(ranks)
        mine = grid if grid is not None else mine
    return mine


@dataclass(frozen=True)
class Cube3D:
    """This rank's place (i, j, l) on a p x p x p cube and the groups of its x, y and z lines."""

    layout: CubeLayout
    i: int
    j: int
    l: int  # noqa: E741 - the paper's index name
    x_group: dist.ProcessGroup
    y_group: dist.ProcessGroup
    z_group: dist.ProcessGroup

    @property
    def p(self) -> int:
        return self.layout.p


def build_cube_groups(ranks: Ranks) -> Cube3D | None:
    """Create the x, y and z line groups of the cube over ``ranks``; call on every rank of the job.

    Args:
        ranks: the cube's global ranks (p^3 of them), placed as ``layout.cube_layout`` says.

    Returns:
        This rank's cube, or None on a rank outside ``ranks``.
    """
    layout = cube_layout(ranks)
    me = dist.get_rank()
    lines = {
        direction: {
            members: dist.new_group(list(members)) for members in getattr(layout, direction)
        }
        for direction in ("x", "y", "z")
    }
    if me not in layout.ranks:
        return None
    mine = {d: next(g for members, g in lines[d].items() if me in members) for d in lines}
    i, j, l = layout.coords(me)  # noqa: E741
    return Cube3D(layout, i, j, l, mine["x"], mine["y"], mine["z"])
