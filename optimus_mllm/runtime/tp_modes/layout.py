"""Ranks of a 2D (q x q grid) and a 3D (p x p x p cube) tensor-parallel group, placed so the most
frequent collectives run between contiguous ranks (inside a node when the group fills nodes in
rank order).

2D (Xu et al., "An Efficient 2D Method for Training Super-Large Deep Learning Models", §2.4).
Rank (i, j) holds block (i, j) of every matrix. Per SUMMA linear layer a row carries q broadcasts
of the activation block forward, q reduces of its gradient and q broadcasts of it again for the
weight gradient; the layer norm's statistics are all-reduced along rows too. A column carries the
weight's broadcasts and its gradient's reduces, whose volume is the weight's, and the row-0 hosted
vectors (biases, norm weights). Rows are therefore contiguous: grid (i, j) is ``ranks[i * q + j]``.

3D (Bian et al., "Maximizing Parallelism in Distributed Training for Huge Neural Networks", §2.3,
3.1). Processor (i, j, l) sits at x = i, y = j, z = l. Activations are all-gathered along y and
reduce-scattered along z, the two swapping after every linear layer; weights are all-gathered
along x. y runs fastest and z next, so the activation directions stay inside a y-z plane of p^2
consecutive ranks: cube (i, j, l) is ``ranks[(i * p + l) * p + j]``.
"""

from __future__ import annotations

from dataclasses import dataclass

Ranks = tuple[int, ...]


def _side(ranks: Ranks, power: int, mode: str) -> int:
    """The grid's side: ``len(ranks) ** (1 / power)`` when that is a whole number."""
    side = round(len(ranks) ** (1.0 / power))
    if side < 1 or side**power != len(ranks):
        raise ValueError(
            f"{mode} tensor parallelism needs a {'square' if power == 2 else 'cube'}"
            f" number of ranks, got {len(ranks)}"
        )
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{mode} tensor parallelism: ranks repeat in {ranks}")
    return side


@dataclass(frozen=True)
class GridLayout:
    """A q x q grid over ``ranks``: ``rows[i]`` holds (i, 0..q-1), ``columns[j]`` (0..q-1, j)."""

    q: int
    ranks: Ranks
    rows: tuple[Ranks, ...]
    columns: tuple[Ranks, ...]

    def rank(self, row: int, column: int) -> int:
        """The global rank at (``row``, ``column``)."""
        return self.ranks[row * self.q + column]

    def coords(self, rank: int) -> tuple[int, int]:
        """(row, column) of the global ``rank``."""
        return divmod(self.ranks.index(rank), self.q)


def grid_layout(ranks: Ranks) -> GridLayout:
    """The 2D grid over ``ranks`` (q^2 of them), rows contiguous.

    Args:
        ranks: the group's global ranks, in order.

    Returns:
        The grid with its row and column rank lists.
    """
    q = _side(ranks, 2, "2D")
    rows = tuple(ranks[i * q : (i + 1) * q] for i in range(q))
    columns = tuple(ranks[j::q] for j in range(q))
    return GridLayout(q=q, ranks=tuple(ranks), rows=rows, columns=columns)


@dataclass(frozen=True)
class CubeLayout:
    """A p x p x p cube over ``ranks``; each direction's groups are the lines along it."""

    p: int
    ranks: Ranks
    x: tuple[Ranks, ...]  # weights are all-gathered along x
    y: tuple[Ranks, ...]  # activations: all-gathered along y, reduce-scattered along z (swapping)
    z: tuple[Ranks, ...]

    def rank(self, i: int, j: int, l: int) -> int:  # noqa: E741 - the paper's index names
        """The global rank of processor (i, j, l)."""
        return self.ranks[(i * self.p + l) * self.p + j]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(i, j, l) of the global ``rank``."""
        il, j = divmod(self.ranks.index(rank), self.p)
        i, l = divmod(il, self.p)  # noqa: E741
        return i, j, l


def cube_layout(ranks: Ranks) -> CubeLayout:
    """The 3D cube over ``ranks`` (p^3 of them), y fastest then z.

    Args:
        ranks: the group's global ranks, in order.

    Returns:
        The cube with the rank lists of its x, y and z lines.
    """
    p = _side(ranks, 3, "3D")
    at = CubeLayout(p=p, ranks=tuple(ranks), x=(), y=(), z=()).rank
    pairs = [(a, b) for a in range(p) for b in range(p)]
    x = tuple(tuple(at(i, j, l) for i in range(p)) for j, l in pairs)  # noqa: E741
    y = tuple(tuple(at(i, j, l) for j in range(p)) for i, l in pairs)  # noqa: E741
    z = tuple(tuple(at(i, j, l) for l in range(p)) for i, j in pairs)  # noqa: E741
    return CubeLayout(p=p, ranks=tuple(ranks), x=x, y=y, z=z)
