"""Synthetic image-text microbatches, the same on every rank and under every parallel plan.

A sample is one image per encoder, given as flattened patches ``[seq_length, in_channels *
patch_size**2]``, and ``llm.seq_length`` tokens whose first ``sum(encoder seq_length)`` positions are
image tokens (replaced by the projected encoder output) and the rest text. The loss covers the text
positions' next-token predictions. Every tensor is drawn from a generator seeded by (seed, iteration,
global microbatch), so a microbatch does not depend on which rank or plan produces it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from optimus_mllm.config import OptimusConfig


@dataclass(frozen=True)
class Microbatch:
    images: tuple[torch.Tensor, ...]  # per encoder: [micro_batch, seq_length, patch_dim]
    tokens: torch.Tensor  # [micro_batch, llm_seq]
    labels: torch.Tensor  # [micro_batch, llm_seq]: the next token
    loss_mask: torch.Tensor  # [micro_batch, llm_seq]: 1 on text positions
    position_ids: torch.Tensor  # [micro_batch, llm_seq]

    @property
    def num_image_tokens(self) -> int:
        return sum(image.shape[1] for image in self.images)


def image_token_count(config: OptimusConfig) -> int:
    return sum(e.seq_length for e in config.encoders)


def synthetic_microbatch(config: OptimusConfig, iteration: int, global_microbatch: int) -> Microbatch:
    """Microbatch ``global_microbatch`` (counted over all data-parallel replicas) of ``iteration``."""
    t, llm = config.training, config.llm
    generator = torch.Generator().manual_seed(zlib.crc32(f"{t.seed}:{iteration}:{global_microbatch}".encode()))
    images = tuple(torch.randn(t.micro_batch_size, e.seq_length, e.in_channels * e.patch_size**2,
                               generator=generator) for e in config.encoders)
    sequence = torch.randint(0, llm.vocab_size, (t.micro_batch_size, llm.seq_length + 1), generator=generator)
    loss_mask = torch.ones(t.micro_batch_size, llm.seq_length)
    loss_mask[:, : image_token_count(config)] = 0.0
    positions = torch.arange(llm.seq_length).unsqueeze(0).expand(t.micro_batch_size, -1)
    return Microbatch(images, sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous(), loss_mask,
                      positions.contiguous())
