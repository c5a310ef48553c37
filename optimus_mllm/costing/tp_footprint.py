"""Per-rank bytes of one transformer layer (megatron-core's local GPT layer: layer norms, fused
QKV with bias, dot-product attention, output projection, GELU MLP with biases) under 1D (Megatron),
2D (SUMMA) and 3D tensor parallelism, as plain formulas (no torch) for the memory model to call.

Activations are what autograd saves for the backward pass during the layer's forward, counted
once per storage (views of one tensor, as Q, K and V of the fused QKV output, are one), less the
parameters and the attention mask (an input). Per layer, with e bytes an element:

1D at TP t (every rank):
  e * [2 (sbh + 2sb)   two layer norms' inputs, means and inverse stds (torch saves them)
       + 2 sbh         the norms' outputs, whole: the column-parallel linears' inputs
       + 3 sbh / t     QKV output (Q and K for the scores, V for the context)
       + b n s^2 / t   attention probabilities
       + sbh / t       context, the row-parallel projection's input
       + 2 sbf / t]    fc1 output (GELU's input) and GELU output (fc2's input)

2D on a q x q grid (Xu et al. §3.1.1: activations are split too), every rank: the same terms
split q^2 ways (tokens by row, hidden or heads by column), except that each norm saves x_hat
(sbh / q^2) and 1/std (sb / q, per token of the row's b/q sequences) instead of its input, mean
and 1/std; rows below 0 also keep the two norm weights' blocks they received (2 h / q).

3D on a p x p x p cube (Bian et al. §3.1), every rank: the norms as in 2D with b/p^2 sequences
and h/p hidden (x_hat sbh / p^3, 1/std sb / p^2, the gathered weight h / p); each linear keeps
its input all-gathered along one direction (p times its shard: sbh / p^2, fc2's sbf / p^2) and
its weight all-gathered along x (the matrices / p^2); the QKV output, the probabilities and the
GELU input are split p^3 ways.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerShape:
    """One layer's sizes: the microbatch ``[seq, batch]``, hidden, heads, MLP hidden, bytes per
    element."""

    seq: int
    batch: int
    hidden: int
    heads: int
    ffn: int
    element_bytes: int = 4


def _matrices(shape: LayerShape) -> int:
    """Elements of the four weight matrices: QKV (3h x h), projection (h x h), fc1, fc2."""
    return 4 * shape.hidden**2 + 2 * shape.hidden * shape.ffn


def parameter_bytes_1d(shape: LayerShape, tp: int) -> int:
    """Bytes of one rank's parameters under Megatron's 1D TP of size ``tp``.

    The matrices, QKV's and fc1's biases are split ``tp`` ways; the norms' weights and biases and
    the row-parallel layers' biases (projection, fc2) are whole on every rank."""
    h, f = shape.hidden, shape.ffn
    split = _matrices(shape) + 3 * h + f
    whole = 4 * h + 2 * h
    return shape.element_bytes * (split // tp + whole)


def parameter_bytes_2d(shape: LayerShape, q: int, row: int) -> int:
    """Bytes of the parameters of the rank in grid row ``row`` on a ``q`` x ``q`` grid.

    Every rank holds a 1/q^2 block of each matrix; the vectors (norms, biases: 4h + 3h + h + f
    + h) are hosted by row 0 alone, 1/q of each there (Xu et al. §3.2.2, Fig. 5)."""
    h, f = shape.hidden, shape.ffn
    vectors = (4 * h + 5 * h + f) // q if row == 0 else 0
    return shape.element_bytes * (_matrices(shape) // q**2 + vectors)


def activation_bytes_1d(shape: LayerShape, tp: int) -> int:
    """Bytes one rank saves for backward under Megatron's 1D TP of size ``tp`` (module doc)."""
    s, b, h, n, f = shape.seq, shape.batch, shape.hidden, shape.heads, shape.ffn
    whole = 2 * (s * b * h + 2 * s * b) + 2 * s * b * h
    split = 3 * s * b * h + b * n * s * s + s * b * h + 2 * s * b * f
    return shape.element_bytes * (whole + split // tp)


def activation_bytes_2d(shape: LayerShape, q: int, row: int) -> int:
    """Bytes the rank in grid row ``row`` saves for backward on a ``q`` x ``q`` grid (module
    doc): the norms' x_hat and 1/std, then as in 1D their outputs, the QKV output, the
    probabilities, the context and the MLP's two activations, all split q^2 ways. Rows below 0
    also keep the two norm weights' received blocks, which the affine step saves."""
    s, b, h, n, f = shape.seq, shape.batch, shape.hidden, shape.heads, shape.ffn
    split = 2 * s * b * h + 2 * s * b * h + 3 * s * b * h + b * n * s * s
    split += s * b * h + 2 * s * b * f
    per_token = 2 * s * b // q
    received = 2 * h // q if row > 0 else 0
    return shape.element_bytes * (split // q**2 + per_token + received)


def parameter_bytes_3d(shape: LayerShape, p: int, on_diagonal: bool) -> int:
    """Bytes of the parameters of a rank on a ``p`` x ``p`` x ``p`` cube.

    Every rank holds a 1/p^3 block of each matrix; the vectors are hosted on the j = l diagonal
    alone, 1/p^2 of each there (Bian et al. §3.1.1, Fig. 5)."""
    h, f = shape.hidden, shape.ffn
    vectors = (4 * h + 5 * h + f) // p**2 if on_diagonal else 0
    return shape.element_bytes * (_matrices(shape) // p**3 + vectors)


def activation_bytes_3d(shape: LayerShape, p: int) -> int:
    """Bytes a rank saves for backward on a ``p`` x ``p`` x ``p`` cube (module doc)."""
    s, b, h, n, f = shape.seq, shape.batch, shape.hidden, shape.heads, shape.ffn
    norms = 2 * (s * b * h // p**3 + s * b // p**2 + h // p)
    gathered_inputs = (3 * s * b * h + s * b * f) // p**2
    gathered_weights = _matrices(shape) // p**2
    split = (3 * s * b * h + b * n * s * s + s * b * f) // p**3
    return shape.element_bytes * (norms + gathered_inputs + gathered_weights + split)
