"""GPU memory per rank: model states (k bytes/param) and activations (Korthikanti et al., 2022).

Model states. With mixed precision and Megatron's distributed optimizer every rank holds its shard
of the 16-bit parameters and of the fp32 main gradients: k = 2 + 4 = 6 bytes per parameter (paper
§4.5). The Adam states (fp32 master copy and two moments, 12 bytes; 8 with fp32 parameters, which
are their own master copy) are divided over the data-parallel ranks.

Activations of one transformer layer for one microbatch, in bytes (s sequence, b microbatch, h
hidden, a heads, t tensor-parallel size; Korthikanti et al. §4):
  no parallelism                    s*b*h*(34 + 5*a*s/h)
  tensor parallel                   s*b*h*(10 + 24/t + 5*a*s/(h*t))
  tensor + sequence parallel        s*b*h*(34 + 5*a*s/h) / t
  ... + selective recomputation     s*b*h*34 / t            (without SP: s*b*h*(10 + 24/t))
  full recomputation                2*s*b*h / t             (the layer input only;
                                                            without SP: 2*s*b*h)
The formula assumes 16-bit activations, an MLP of 4h and one key/value head per query head; for
other shapes it is the usual approximation.

With 1F1B the first pipeline stage holds activations of ``pp`` microbatches for its L/pp layers,
i.e. of L layers; the interleaved schedule multiplies that by (1 + (pp-1)/(pp*vp)).

TP modes (issues 36, 37). Under 2d, 3d and metp a layer's activations are the bytes the runtime's
layer keeps (``tp_memory``, from the 2D, 3D and METP papers), at 16 bits as above; with full
recomputation the rank's share of the layer input (each mode splits it over all its ranks).
Selective recomputation is megatron-core's 1D one and changes nothing there. Model states stay
parameters / t in every mode: each splits every matrix t ways, and the vectors they place
differently are O(h) per layer.

Encoders. The paper leaves encoder activations out as negligible; we keep them, because under
Optimus an encoder pipeline holds the activations of every microbatch it has run forward until the
LLM returns that microbatch's gradient (the coarse schedule runs all forwards first).
"""

from __future__ import annotations

from dataclasses import dataclass

from optimus_mllm.config import OptimusConfig, Recompute, TPMode, TransformerSpec
from optimus_mllm.costing.tp_memory import layer_bytes
from optimus_mllm.costing.workload import max_images_per_microbatch

GIB = 1024**3

PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MAIN_GRAD_BYTES = 4  # Megatron accumulates and reduces gradients in fp32
ACTIVATION_BYTES = 2  # Korthikanti et al.'s 16-bit activations


def param_bytes(config: OptimusConfig) -> int:
    return PARAM_BYTES[config.training.precision]


def bytes_per_param_k(config: OptimusConfig) -> int:
    """k of paper §4.5: parameter plus main-gradient bytes per parameter held by every replica."""
    return param_bytes(config) + MAIN_GRAD_BYTES


def optimizer_bytes_per_param(config: OptimusConfig) -> int:
    """Adam: two fp32 moments; SGD: one fp32 momentum, none without momentum; plus an fp32 master
    copy when parameters are 16-bit (megatron-core's optimizers)."""
    t = config.training
    master = 0 if t.precision == "fp32" else 4
    if t.optimizer == "sgd":
        return master + (4 if t.sgd_momentum > 0 else 0)
    return master + 8


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU."""

    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(
            self.params + other.params,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
            self.activations + other.activations,
        )

    def as_gib(self) -> dict[str, float]:
        return {
            k: round(v / GIB, 3)
            for k, v in {
                "params": self.params,
                "grads": self.grads,
                "optimizer": self.optimizer,
                "activations": self.activations,
                "total": self.total,
            }.items()
        }


def model_state_memory(config: OptimusConfig, params_per_rank: float, dp: int) -> MemoryBreakdown:
    """Parameters, gradients and optimizer states of ``params_per_rank`` parameters on one rank."""
    opt = optimizer_bytes_per_param(config) * params_per_rank
    if config.training.distributed_optimizer:
        opt /= dp
    return MemoryBreakdown(
        param_bytes(config) * params_per_rank, MAIN_GRAD_BYTES * params_per_rank, opt, 0.0
    )


def layer_activation_bytes(
    spec: TransformerSpec,
    micro_batch_size: int,
    tp: int,
    sequence_parallel: bool,
    recompute: Recompute,
) -> float:
    """Korthikanti et al.'s activation memory of one layer and one microbatch on one TP rank."""
    s, b, h, a = spec.layer_tokens, micro_batch_size, spec.hidden_size, spec.num_attention_heads
    sbh = s * b * h
    sp = sequence_parallel and tp > 1
    if recompute == "full":
        return 2 * sbh / tp if sp else 2 * sbh
    attention_scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh * (34 + attention_scores) / tp
    return sbh * (10 + 24 / tp + attention_scores / tp)


def mode_layer_activation_bytes(
    spec: TransformerSpec,
    micro_batch_size: int,
    tp: int,
    tp_mode: TPMode,
    sequence_parallel: bool,
    recompute: Recompute,
) -> float:
    """Activation bytes of one layer and one microbatch on the fullest rank of ``tp`` under
    ``tp_mode``: Korthikanti et al.'s for 1d, the runtime layer's for the others (module doc)."""
    if tp_mode == "1d":
        return layer_activation_bytes(spec, micro_batch_size, tp, sequence_parallel, recompute)
    if recompute == "full":
        return ACTIVATION_BYTES * spec.layer_tokens * micro_batch_size * spec.hidden_size / tp
    return layer_bytes(spec, tp_mode, tp, micro_batch_size, ACTIVATION_BYTES).activations


def interleaving_factor(pp: int, vp: int) -> float:
    """Extra in-flight activations of the interleaved schedule on the first stage."""
    return 1 + (pp - 1) / (pp * vp) if vp > 1 else 1.0


def llm_activation_memory(
    config: OptimusConfig, pp: int, tp: int, vp: int, tp_mode: TPMode = "1d"
) -> float:
    """Peak activation bytes on the first LLM pipeline stage (the fullest under 1F1B)."""
    t = config.training
    per_layer = mode_layer_activation_bytes(
        config.llm, t.micro_batch_size, tp, tp_mode, t.sequence_parallel, t.recompute
    )
    microbatches_in_flight = min(
        pp, config.num_microbatches_total // (config.cluster.num_gpus // (pp * tp))
    )
    layers_per_stage = config.llm.num_layers / pp
    return per_layer * layers_per_stage * microbatches_in_flight * interleaving_factor(pp, vp)


def encoder_activation_memory_per_microbatch(
    config: OptimusConfig, pp: int, tp: int, tp_mode: TPMode = "1d"
) -> float:
    """Activation bytes one microbatch leaves on the fullest encoder stage (all encoders
    together), at the most images per microbatch memory is planned for
    (``data.max_images_per_microbatch``; one per sample without it)."""
    t = config.training
    images = max_images_per_microbatch(config)
    total = 0.0
    for enc in config.encoders:
        if enc.frozen:
            continue  # forward only: nothing is kept for a backward pass
        per_layer = mode_layer_activation_bytes(
            enc, images, tp, tp_mode, t.sequence_parallel, t.recompute
        )
        total += per_layer * -(-enc.num_layers // pp)
    return total


def colocation_overhead(k: float, dp_enc: int, dp_llm: int, phi_enc: float, n_gpu: int) -> float:
    """Paper §4.5: MEM_overhead = k (DP_enc − DP_llm) Φ_enc / n_gpu, against DP_enc = DP_llm."""
    return k * (dp_enc - dp_llm) * phi_enc / n_gpu
