"""torch objects named by the config: precisions and MLP activations."""

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}
