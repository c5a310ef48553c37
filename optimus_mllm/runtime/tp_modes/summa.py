"""The 2D paper's SUMMA products on a q x q grid (Xu et al., §2.4, Algorithms 1-3) and the
row-0 hosting of vectors (§3.2.2, Fig. 5), with the backward passes the paper derives.

Every matrix is split in q x q blocks, rank (i, j) holding block (i, j). The three products form
a closed set under differentiation (the paper's Eq. 1-3), so a linear layer Y = X W runs
``summa_ab`` forward and ``summa_abt`` (dX = dY W^T) and ``summa_atb`` (dW = X^T dY) backward:
only broadcasts and reduces inside one row or one column.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from optimus_mllm.runtime.tp_modes.groups import Grid2D


def _broadcast(block: Tensor, src: int, me: int, group: dist.ProcessGroup) -> Tensor:
    """``block`` from global rank ``src`` on every rank of ``group`` (``block`` gives the shape)."""
    out = (
        block.contiguous()
        if me == src
        else torch.empty_like(block, memory_format=torch.contiguous_format)
    )
    dist.broadcast(out, src=src, group=group)
    return out


def summa_ab(a: Tensor, b: Tensor, grid: Grid2D) -> Tensor:
    """Block (i, j) of C = A B (Algorithm 1): C_ij = sum_l A_il B_lj.

    A_il is broadcast along row i from (i, l), B_lj along column j from (l, j)."""
    i, j, me = grid.row, grid.column, dist.get_rank()
    c = a.new_zeros(a.shape[0], b.shape[1])
    for l in range(grid.q):  # noqa: E741 - the paper's loop index
        a_il = _broadcast(a, grid.rank(i, l), me, grid.row_group)
        b_lj = _broadcast(b, grid.rank(l, j), me, grid.column_group)
        c.addmm_(a_il, b_lj)
    return c


def _reduced_products(
    moving: Tensor, times: Callable[[Tensor], Tensor], grid: Grid2D, along_row: bool
) -> Tensor:
    """Algorithms 2 and 3: for each l, ``times`` the block of ``moving`` broadcast from the l-th
    rank of this rank's column (``along_row``: row), reduced along the other line to its l-th rank.
    Returns the sum reduced to this rank."""
    me = dist.get_rank()
    row = [grid.rank(grid.row, k) for k in range(grid.q)], grid.row_group
    column = [grid.rank(k, grid.column) for k in range(grid.q)], grid.column_group
    (sources, along), (owners, across) = (row, column) if along_row else (column, row)
    c = None
    for src, dst in zip(sources, owners, strict=True):
        partial = times(_broadcast(moving, src, me, along))
        dist.reduce(partial, dst=dst, group=across)
        if dst == me:
            c = partial
    assert c is not None
    return c


def summa_abt(a: Tensor, b: Tensor, grid: Grid2D) -> Tensor:
    """Block (i, j) of C = A B^T (Algorithm 2): C_il = sum_j A_ij B_lj^T.

    B_lj is broadcast along column j from (l, j); the partial products are reduced along row i to
    (i, l)."""
    return _reduced_products(b, lambda b_lj: a @ b_lj.t(), grid, along_row=False)


def summa_atb(a: Tensor, b: Tensor, grid: Grid2D) -> Tensor:
    """Block (i, j) of C = A^T B (Algorithm 3): C_lj = sum_i A_il^T B_ij.

    A_il is broadcast along row i from (i, l); the partial products are reduced along column j to
    (l, j)."""
    return _reduced_products(a, lambda a_il: a_il.t() @ b, grid, along_row=True)


class SummaLinear(torch.autograd.Function):
    """Y = X W on the grid: X block [tokens/q, in/q] and W block [in/q, out/q] give Y block
    [tokens/q, out/q]."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, grid: Grid2D) -> Tensor:
        # weight is megatron-core's [out, in] orientation: this rank's block of W is weight^T
        ctx.save_for_backward(x, weight)
        ctx.grid = grid
        return summa_ab(x, weight.t(), grid)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = summa_abt(grad_y, weight.t(), ctx.grid)
        grad_w = summa_atb(x, grad_y, ctx.grid)
        return grad_x, grad_w.t(), None


class FromRowZero(torch.autograd.Function):
    """A vector block hosted on row 0 (``vector`` there, a placeholder of its shape elsewhere),
    broadcast down column j forward; its gradient reduced back to (0, j) (the paper's Fig. 5)."""

    @staticmethod
    def forward(ctx: Any, vector: Tensor, grid: Grid2D) -> Tensor:
        ctx.grid = grid
        return _broadcast(vector, grid.rank(0, grid.column), dist.get_rank(), grid.column_group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        grid = ctx.grid
        total = grad.contiguous().clone()
        dist.reduce(total, dst=grid.rank(0, grid.column), group=grid.column_group)
        return (total if grid.row == 0 else None), None


class RowStatsNorm(torch.autograd.Function):
    """(x - E[x]) / sqrt(Var[x] + eps) over a hidden dimension split across ``group`` (the grid's
    row, §3.2.2; the 3D layers use it across a cube line too).

    Forward: the local sums of x and x^2 are all-reduced along the row in one call, and
    Var[x] = E[x^2] - E[x]^2. Backward: dx = r (g - E[g] - x_hat E[g x_hat]) with r the inverse
    std, the two means again all-reduced along the row together."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, hidden: int, eps: float, group: dist.ProcessGroup) -> Tensor:
        sums = torch.stack([x.sum(-1), (x * x).sum(-1)])
        dist.all_reduce(sums, group=group)
        mean, mean_sq = sums / hidden
        inv_std = torch.rsqrt(mean_sq - mean * mean + eps)
        x_hat = (x - mean.unsqueeze(-1)) * inv_std.unsqueeze(-1)
        ctx.save_for_backward(x_hat, inv_std)
        ctx.hidden, ctx.group = hidden, group
        return x_hat

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        x_hat, inv_std = ctx.saved_tensors
        sums = torch.stack([grad.sum(-1), (grad * x_hat).sum(-1)])
        dist.all_reduce(sums, group=ctx.group)
        mean_g, mean_gx = (sums / ctx.hidden).unsqueeze(-1)
        grad_x = inv_std.unsqueeze(-1) * (grad - mean_g - x_hat * mean_gx)
        return grad_x, None, None, None
