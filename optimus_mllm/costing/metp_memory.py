"""Per-rank peak intermediate memory of METP and of Megatron TP+SP, in elements (issue 37).

The paper's formulas (Liang et al., 2025, Tables 1-2, Eq. 10) count a layer's activations, not its
weights: b batch, s sequence, h hidden, n heads, p ranks; its FFN is h -> 4h -> h, written here with
``ffn`` in place of 4h. ``k`` is 1 without FlashAttention (the scores tile is stored), 0 with it.

``runtime.metp``'s forward adds buffers the paper leaves out; ``metp_mlp_forward_peak`` and
``metp_attention_forward_bound`` add them by name, so that what a rank measures can be held against
them. Plain arithmetic: the planner may import it (no torch).
"""

from __future__ import annotations


def paper_mlp_peak(b: int, s: int, h: int, ffn: int, p: int) -> dict[str, float]:
    """Table 1's peak activation memory of the FFN (without its 32h^2/p model states)."""
    return {"metp": b * s * h / p + b * s * ffn / p**2, "tp": b * s * h + b * s * ffn / p}


def paper_attention_peak(b: int, s: int, h: int, n: int, p: int, k: int) -> dict[str, float]:
    """Table 2's peak activation memory of attention (without its 16h^2/p model states)."""
    return {
        "metp": 2 * b * s * h / p + 3 * b * s * h / p**2 + k * b * n * s**2 / p**3,
        "tp": 4 * b * s * h / p + b * s * h + k * b * n * s**2 / p,
    }


def paper_attention_ratio(p: int) -> float:
    """Eq. 10: METP's peak over TP's with FlashAttention, (3 + 2p) / (p (4 + p))."""
    return (3 + 2 * p) / (p * (4 + p))


def metp_mlp_forward_peak(tokens: int, h: int, ffn: int, p: int, bias: bool) -> int:
    """``metp_mlp``'s forward peak on a rank holding ``tokens`` (= b s / p) tokens, not gated.

    Table 1's terms (the output, tokens x h, and one tile, tokens x ffn/p) with two additions: the
    activation's input and output tiles are both alive while it runs, and the weight shards received
    are double-buffered (the shards in use and the next ones arriving; one hop in all at p = 2, none
    at p = 1: a rank's own shards are its parameters)."""
    shard = (2 * h + bias) * ffn // p
    return tokens * h + 2 * tokens * ffn // p + min(2, p - 1) * shard


def metp_attention_forward_bound(
    b: int, s: int, h: int, heads: int, groups: int, head_dim: int, p: int, bias: bool
) -> int:
    """An upper bound of ``metp_attention``'s forward peak on any rank (no FlashAttention, k = 1).

    Table 2's terms (the output and the saved attention outputs, 2 b s h / p, where the paper counts
    the input and the attention outputs; q, k and v of one step; the scores tile b n s^2 / p^3) and
    the buffers the paper leaves out: one ring hop of k and v in flight, the running output, the
    block's weighted values and the softmax statistics (maximum, sum and their updates, the saved
    log-sum-exp of every step), and two steps' broadcast QKV / output-projection shards."""
    tokens, context = b * s // p, heads * head_dim
    qkv = (heads + 2 * groups) * head_dim
    per_step_q = tokens * context // p
    kv = 2 * tokens * groups * head_dim // p
    rows = b * heads * s // p**2  # one statistic per query row of one step's heads
    shards = qkv * h // p + h * context // p + (qkv // p if bias else 0)
    return (
        tokens * h  # output
        + tokens * context  # saved attention outputs (all steps)
        + per_step_q
        + kv  # q, k, v
        + b * heads * (s // p) ** 2 // p  # scores
        + kv  # next k, v in flight
        + 2 * per_step_q  # running output, weighted values
        + 4 * rows
        + p * rows  # softmax statistics, saved log-sum-exp
        + 2 * shards
    )


def metp_layer_parameters(
    h: int, qkv: int, context: int, fc1: int, ffn: int, p: int, bias: bool, norm_vectors: int
) -> int:
    """Parameters of one rank of ``metp_layer_spec``'s layer: megatron-core's TP shards (the QKV
    (``qkv`` x h), output-projection (h x ``context``), fc1 (``fc1`` x h; 2 ffn when gated) and fc2
    (h x ``ffn``) matrices, QKV's and fc1's biases split ``p`` ways), and whole on every rank the
    two norms' ``norm_vectors`` and the biases added to the rank's own tokens (projection, fc2)."""
    split = qkv * h + h * context + fc1 * h + h * ffn + (qkv + fc1 if bias else 0)
    return split // p + norm_vectors + (2 * h if bias else 0)


def metp_layer_saved(tokens: int, h: int, heads: int, context: int) -> int:
    """Elements ``metp_layer_spec``'s layer keeps for its backward on a rank of ``tokens`` (= b s /
    p) tokens, the same at any gating or mask: the two norms' inputs and their per-token mean and
    1/std (2 tokens h + 4 tokens); the attention's input (the first norm's output) and each step's
    attention output (tokens x context over all steps) and log-sum-exp (one per head and token);
    the MLP's input alone (its backward recomputes every tile). Nothing of size s x s / p."""
    return 4 * tokens * h + 4 * tokens + tokens * context + heads * tokens
