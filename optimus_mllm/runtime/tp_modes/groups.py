"""The ``torch.distributed`` groups of a 2D grid (its rows and columns), from ``layout``.

``torch.distributed.new_group`` must be called by every rank of the job, for every group, in the
same order, so ``build_grid_groups`` creates all rows and then all columns on each rank and keeps
the two this rank belongs to. The groups are passed to the layers through their ``ModuleSpec``
params, never looked up from a global, so an encoder and an LLM may use different grids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from optimus_mllm.runtime.tp_modes.layout import GridLayout, Ranks, grid_layout


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
