"""Dropout masks that depend on neither the order ops run in nor, for the encoder, its parallel
plan.

Optimus runs a step's microbatches in another order than Megatron does (adjusted warm-up, encoder
ops at hook points), and the encoder under another plan; the masks must still be the baseline's, or
the two runtimes train different models. So nothing draws from a generator that carries state from
one microbatch to the next:

- LLM: megatron-core's own dropout (hidden dropout in its bias-dropout-add and embedding, attention
  dropout under its RNG tracker's model-parallel state). ``seed_llm_dropout`` re-seeds the default
  generator and the tracker before each forward step from (seed, iteration, global microbatch, model
  chunk); megatron-core's activation checkpointing restores those states for recompute.
- Encoder: ``dropout`` draws a mask whole, for the unsharded tensor, from a private generator seeded
  by (microbatch seed, site), then keeps this rank's share (heads under TP, tokens under sequence
  parallelism): any encoder plan and a recomputed forward draw the same mask. Drawing whole costs TP
  times the random numbers of the shard, small next to the GEMMs.

No generator state outlives a forward step, so a checkpoint needs no RNG state for an exact resume.
"""

from __future__ import annotations

import zlib

import torch
from megatron.core import parallel_state, tensor_parallel


def microbatch_seed(seed: int, iteration: int, global_microbatch: int) -> int:
    """The seed of one microbatch's dropout masks (global: counted over the LLM's data-parallel
    replicas)."""
    return zlib.crc32(f"dropout:{seed}:{iteration}:{global_microbatch}".encode())


def site_seed(microbatch: int, site: str) -> int:
    """The seed of one dropout site (``encoder:layer:where``) for one microbatch."""
    return zlib.crc32(f"{microbatch}:{site}".encode())


def seed_llm_dropout(microbatch: int, chunk: int) -> None:
    """Before the forward of LLM model chunk ``chunk`` (its virtual stage counted over the whole
    pipeline)
    on one microbatch: megatron-core's generators from the microbatch's seed. The tracker's
    model-parallel state differs per TP rank (megatron-core adds the TP rank), the default one is
    shared by the TP group, as ``model_parallel_cuda_manual_seed`` sets them up at start."""
    seed = site_seed(microbatch, f"llm:{chunk}")
    torch.manual_seed(seed)  # on the CPU the default generator plays the CUDA generator's part
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def llm_chunk_index(chunk: int) -> int:
    """The virtual stage of this rank's ``chunk`` over the whole pipeline."""
    return (
        chunk * parallel_state.get_pipeline_model_parallel_world_size()
        + parallel_state.get_pipeline_model_parallel_rank()
    )


def dropout(
    x: torch.Tensor,
    p: float,
    seed: int,
    whole: tuple[int, ...],
    dim: int = 0,
    parts: int = 1,
    part: int = 0,
) -> torch.Tensor:
    """``x`` with each element zeroed with probability ``p`` and the rest scaled by 1 / (1 - p);
    ``x`` is
    part ``part`` of ``parts`` equal chunks along ``dim`` of a tensor shaped ``whole``, and its mask
    that part of the mask drawn for ``whole`` from ``seed``."""
    if p == 0.0:
        return x
    generator = torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.rand(whole, generator=generator, device=x.device) >= p
    keep = keep.chunk(parts, dim=dim)[part]
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))
