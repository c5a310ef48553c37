"""torch objects named by the config: precisions and MLP activations."""

import torch
import torch.nn.functional as F
from megatron.core.activations import quick_gelu, squared_relu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the config's ``Activation`` names: the very callables megatron-core's configs hold, so that a
# user's ``TransformerConfig.activation_func`` is named by identity
ACTIVATIONS = {
    "gelu": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "squared_relu": squared_relu,
    "quick_gelu": quick_gelu,
}
