"""Parameter counts of the encoder(s), projector(s) and LLM, whole and per pipeline stage."""

from __future__ import annotations

from optimus_mllm.config import EncoderConfig, LLMConfig, TransformerSpec


def norm_params(spec: TransformerSpec) -> int:
    return 2 * spec.hidden_size if spec.normalization == "LayerNorm" else spec.hidden_size


def attention_params(spec: TransformerSpec) -> int:
    h, d = spec.hidden_size, spec.head_dim
    q_width, kv_width = spec.num_attention_heads * d, spec.query_groups * d
    weights = h * (q_width + 2 * kv_width) + q_width * h
    bias = (q_width + 2 * kv_width + h) if spec.add_bias_linear else 0
    return weights + bias


def mlp_params(spec: TransformerSpec) -> int:
    h, f = spec.hidden_size, spec.ffn_hidden_size
    fc1_out = 2 * f if spec.gated_linear_unit else f
    bias = (fc1_out + h) if spec.add_bias_linear else 0
    return h * fc1_out + f * h + bias


def layer_params(spec: TransformerSpec) -> int:
    """One transformer layer: two norms, attention and MLP."""
    return 2 * norm_params(spec) + attention_params(spec) + mlp_params(spec)


def encoder_params(enc: EncoderConfig) -> int:
    """The ViT alone (patch embedding, class token, position embedding, layers), without projector.
    Like the runtime's ViT (and the cost model's encoder kernels) it has no final norm: the last
    layer's output goes to the projector."""
    clip = enc.model_subtype == "clip"  # a conv without a bias, and ln_pre
    patch_embed = enc.in_channels * enc.patch_size**2 * enc.hidden_size + (
        0 if clip else enc.hidden_size
    )
    class_token = enc.class_tokens * enc.hidden_size
    pos_embed = enc.layer_tokens * enc.hidden_size  # the class token has its own
    ln_pre = norm_params(enc) if clip else 0
    return patch_embed + class_token + pos_embed + ln_pre + enc.num_layers * layer_params(enc)


def projector_params(enc: EncoderConfig, llm: LLMConfig) -> int:
    """LLaVA-style projector from the encoder's (merged) width into the LLM's: one GEMM
    (``affine``, ``linear``) or megatron-core's MLP (``mlp``: fc1 to the projector's ffn width,
    twice that when gated, fc2 to the LLM's hidden size)."""
    projector, h_in, h_llm = enc.projector, enc.projector_input_size, llm.hidden_size
    bias = projector.add_bias_linear
    if projector.type != "mlp":
        return h_in * h_llm + (h_llm if bias else 0)
    ffn = projector.mlp_ffn_hidden_size(h_llm)
    fc1_out = 2 * ffn if projector.gated_linear_unit else ffn
    return h_in * fc1_out + ffn * h_llm + ((fc1_out + h_llm) if bias else 0)


def llm_embedding_params(llm: LLMConfig) -> int:
    """Word (and learned position) embeddings, held by the first pipeline stage."""
    pos = (
        llm.seq_length * llm.hidden_size if llm.position_embedding_type == "learned_absolute" else 0
    )
    return llm.vocab_size * llm.hidden_size + pos


def llm_output_params(llm: LLMConfig) -> int:
    """Final norm plus the output layer when untied; held by the last pipeline stage."""
    head = llm.vocab_size * llm.hidden_size if llm.untie_embeddings_and_output_weights else 0
    return norm_params(llm) + head


def llm_params(llm: LLMConfig) -> int:
    return llm_embedding_params(llm) + llm.num_layers * layer_params(llm) + llm_output_params(llm)


def llm_params_per_stage(llm: LLMConfig, pp: int) -> list[int]:
    """Parameters of each LLM pipeline stage (before TP sharding).

    The first stage holds the embeddings, the last the final norm and output layer; with tied
    embeddings Megatron keeps a copy of the word embedding on the last stage as well.
    """
    if pp == 1:
        return [llm_params(llm)]
    per_stage = [llm.num_layers // pp * layer_params(llm)] * pp
    tied_copy = 0 if llm.untie_embeddings_and_output_weights else llm.vocab_size * llm.hidden_size
    per_stage[0] += llm_embedding_params(llm)
    per_stage[-1] += llm_output_params(llm) + tied_copy
    return per_stage


def llm_stage_params(llm: LLMConfig, pp: int) -> int:
    """Parameters of the heaviest LLM pipeline stage (before TP sharding)."""
    return max(llm_params_per_stage(llm, pp))


def encoder_params_per_stage(
    encoders: tuple[EncoderConfig, ...], llm: LLMConfig, pp: int
) -> list[int]:
    """Parameters of each encoder pipeline stage, all encoders (and projectors) together.

    Each encoder's layers are split evenly over the ``pp`` stages (paper Fig. 14); the patch and
    position embeddings sit on the first stage, the projector on the last.
    """
    per_stage = [0] * pp
    for enc in encoders:
        for s, (lo, hi) in enumerate(stage_layer_bounds(enc.num_layers, pp)):
            per_stage[s] += (hi - lo) * layer_params(enc)
        per_stage[0] += encoder_params(enc) - enc.num_layers * layer_params(enc)
        per_stage[-1] += projector_params(enc, llm)
    return per_stage


def stage_layer_bounds(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges of ``pp`` stages, as even as possible (earlier stages take the
    extra)."""
    base, extra = divmod(num_layers, pp)
    bounds, lo = [], 0
    for s in range(pp):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds
