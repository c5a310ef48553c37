"""Per-rank bytes of one transformer layer under each TP mode (issues 36 and 37), from the papers'
formulas as the runtime's layers realize them; plain arithmetic, no torch.

- ``2d``: SUMMA on a q x q grid (Xu et al.), ``runtime/tp_modes/layers_2d``; bytes from
  ``tp_footprint``. The fullest rank hosts the vectors (grid row 0) for parameters and receives
  them (rows below 0) for activations.
- ``3d``: a p x p x p cube (Bian et al.), ``runtime/tp_modes/layers_3d``; ``tp_footprint``. The
  fullest rank is on the diagonal that hosts the vectors.
- ``metp``: the ring (Liang et al.), ``runtime/metp``; ``metp_memory``. Every rank holds the same.
- ``1d``: megatron-core's local layer as ``tp_footprint`` counts it. The planner's own 1D figure
  stays Korthikanti et al.'s (``memory_model.layer_activation_bytes``: sequence parallelism,
  recomputation, dropout masks), so that a 1D plan's memory is what it was before the modes.

At the same total degree t, 1D keeps the norms' inputs and outputs whole on every rank (8 s b h
bytes at 16 bits, whatever t), 2D and 3D split them too and METP keeps 1/t of the tokens: the
papers' activation saving. The test holding these figures against the bytes each runtime layer
holds (counted on gloo ranks) is in ``tests/distributed/test_tp_modes.py`` and ``test_metp.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimus_mllm.config import TPMode, TransformerSpec
from optimus_mllm.costing.metp_memory import metp_layer_parameters, metp_layer_saved
from optimus_mllm.costing.tp_footprint import (
    LayerShape,
    activation_bytes_1d,
    activation_bytes_2d,
    activation_bytes_3d,
    parameter_bytes_1d,
    parameter_bytes_2d,
    parameter_bytes_3d,
)


@dataclass(frozen=True)
class LayerBytes:
    """One layer's bytes on the fullest rank: parameters, and what autograd keeps for backward."""

    parameters: int
    activations: int


def mode_degree(mode: TPMode, tp: int) -> int:
    """The grid side of ``mode`` at total degree ``tp``: q for 2d (tp = q^2), p for 3d (tp = p^3),
    ``tp`` itself for 1d and metp. The config holds ``tp`` a valid degree of its mode."""
    root = {"2d": 2, "3d": 3}.get(mode, 1)
    return round(tp ** (1 / root))


def layer_bytes(
    spec: TransformerSpec, mode: TPMode, tp: int, micro_batch: int, element_bytes: int
) -> LayerBytes:
    """Bytes of one of ``spec``'s layers on the fullest of its ``tp`` ranks under ``mode``, for a
    microbatch of ``micro_batch`` sequences (images, for an encoder) of ``element_bytes``
    elements."""
    shape = LayerShape(
        seq=spec.layer_tokens,
        batch=micro_batch,
        hidden=spec.hidden_size,
        heads=spec.num_attention_heads,
        ffn=spec.ffn_hidden_size,
        element_bytes=element_bytes,
    )
    side = mode_degree(mode, tp)
    if mode == "1d":
        return LayerBytes(parameter_bytes_1d(shape, tp), activation_bytes_1d(shape, tp))
    if mode == "2d":
        receiving_row = min(1, side - 1)
        return LayerBytes(
            parameter_bytes_2d(shape, side, 0), activation_bytes_2d(shape, side, receiving_row)
        )
    if mode == "3d":
        return LayerBytes(parameter_bytes_3d(shape, side, True), activation_bytes_3d(shape, side))
    h, context = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    qkv = (spec.num_attention_heads + 2 * spec.query_groups) * spec.head_dim
    fc1 = spec.ffn_hidden_size * (2 if spec.gated_linear_unit else 1)
    norm_vectors = 2 * (2 * h if spec.normalization == "LayerNorm" else h)
    parameters = metp_layer_parameters(
        h, qkv, context, fc1, spec.ffn_hidden_size, tp, spec.add_bias_linear, norm_vectors
    )
    tokens = spec.layer_tokens * micro_batch // tp
    saved = metp_layer_saved(tokens, h, spec.num_attention_heads, context)
    return LayerBytes(element_bytes * parameters, element_bytes * saved)
