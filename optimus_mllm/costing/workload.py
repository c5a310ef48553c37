"""The encoders' work in one microbatch: how many images each encoder runs, at how many tokens.

Today's configs carry one image per sample at the encoder's ``seq_length`` patch tokens, so every
microbatch has the same work (``EncoderWorkload.constant``). Real data carries 0..n images per
sample at several resolutions; an ``IterationWorkload`` holds one ``EncoderWorkload`` per
microbatch of one LLM pipeline, and the cost model, the bubble scheduler and the baselines price
each microbatch by its own. A microbatch without images has no encoder work at all: the LLM does not
wait for one.

Images of one microbatch run as one ViT batch of equal-length sequences, so a microbatch is priced
at its largest image's tokens (``tokens_per_image``); images of other sizes are padded to it.

``WorkloadDistribution`` is the config's ``data.images_per_sample`` / ``data.tokens_per_image``
histograms; ``draw_iterations`` samples iterations from it deterministically from a seed. No torch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from optimus_mllm.config import OptimusConfig
from optimus_mllm.errors import OptimusError


@dataclass(frozen=True)
class EncoderLoad:
    """One encoder's work in one microbatch: ``images`` ViT sequences of ``tokens_per_image``
    patch tokens each (the encoder's ``seq_length`` unit)."""

    images: int
    tokens_per_image: int

    @property
    def tokens(self) -> int:
        return self.images * self.tokens_per_image


@dataclass(frozen=True)
class EncoderWorkload:
    """One microbatch's encoder work: one ``EncoderLoad`` per encoder, in the config's order."""

    loads: tuple[EncoderLoad, ...]

    @classmethod
    def constant(cls, config: OptimusConfig) -> EncoderWorkload:
        """Today's workload: one image per sample at each encoder's ``seq_length``."""
        mbs = config.training.micro_batch_size
        return cls(tuple(EncoderLoad(mbs, e.seq_length) for e in config.encoders))

    @classmethod
    def of_images(
        cls, config: OptimusConfig, images: int, tokens_per_image: int | None = None
    ) -> EncoderWorkload:
        """``images`` per encoder, at ``tokens_per_image`` (default: each encoder's
        ``seq_length``)."""
        return cls(
            tuple(
                EncoderLoad(images, tokens_per_image or e.seq_length) if images else EMPTY_LOAD
                for e in config.encoders
            )
        )

    @property
    def empty(self) -> bool:
        """No encoder runs in this microbatch: the LLM does not wait for encoder output."""
        return all(load.images == 0 for load in self.loads)

    @property
    def images(self) -> int:
        return sum(load.images for load in self.loads)

    def covers(self, other: EncoderWorkload) -> bool:
        """Every encoder runs at least as many images, at least as long, as in ``other``: a
        schedule for this workload holds ``other``'s kernels."""
        return all(
            a.images >= b.images and (b.images == 0 or a.tokens_per_image >= b.tokens_per_image)
            for a, b in zip(self.loads, other.loads)
        )


EMPTY_LOAD = EncoderLoad(0, 0)

# one EncoderWorkload per microbatch of one LLM pipeline, in data order
IterationWorkload = tuple[EncoderWorkload, ...]


def llm_order(workload: IterationWorkload) -> tuple[int, ...]:
    """The data microbatches in the order the LLM runs them under the iteration's own schedule:
    the imageless ones first (no encoder output to wait for), each group in data order."""
    n = range(len(workload))
    return tuple([i for i in n if workload[i].empty] + [i for i in n if not workload[i].empty])


def heaviest(workloads: Sequence[EncoderWorkload]) -> EncoderWorkload:
    """Per encoder, the most images and the longest images of ``workloads``: one workload that
    covers each of them (empty when they all are)."""
    loads = []
    for per_encoder in zip(*(w.loads for w in workloads)):
        images = max(load.images for load in per_encoder)
        tokens = max(load.tokens_per_image for load in per_encoder if load.images) if images else 0
        loads.append(EncoderLoad(images, tokens))
    return EncoderWorkload(tuple(loads))


@dataclass(frozen=True)
class EncoderSplit:
    """An iteration's images as the encoder runs them: encoder microbatches of at most
    ``images_per_chain`` images per encoder, each priced as ``chain``."""

    images_per_chain: int
    chain: EncoderWorkload  # the largest encoder microbatch: what each one is scheduled as
    # per encoder microbatch, in order: the LLM microbatch (its position in the LLM's order) it
    # feeds; an LLM microbatch with n images (per encoder) is fed by ceil(n / images_per_chain),
    # its images in order, images_per_chain each (the last one the rest)
    feeds: tuple[int, ...]


def split_images(
    workload: IterationWorkload, images_per_chain: int | None = None
) -> EncoderSplit | None:
    """``workload`` (in the LLM's order) as encoder microbatches of at most ``images_per_chain``
    images (default: the heaviest microbatch's, one per LLM microbatch with images); None when no
    microbatch has an image."""
    images = [w for w in workload if not w.empty]
    if not images:
        return None
    heavy = heaviest(images)
    per_chain = images_per_chain or max(load.images for load in heavy.loads)
    chain = EncoderWorkload(
        tuple(
            EncoderLoad(min(load.images, per_chain), load.tokens_per_image) for load in heavy.loads
        )
    )
    feeds = []
    for i, w in enumerate(workload):
        feeds += [i] * max(-(-load.images // per_chain) for load in w.loads)
    return EncoderSplit(per_chain, chain, tuple(feeds))


def chain_sizes(workload: IterationWorkload, tries: int = 3) -> tuple[int, ...]:
    """The encoder microbatch sizes worth scheduling an iteration at: its heaviest microbatch's
    images, half of that, a quarter ...: ``tries`` at most, smallest first (the smaller ones
    usually schedule faster, and the first schedule found bounds the search of the next)."""
    most = max((max(load.images for load in w.loads) for w in workload), default=0)
    sizes: list[int] = []
    while most and len(sizes) < tries and (not sizes or most < sizes[-1]):
        sizes.append(most)
        most = -(-most // 2) if most > 1 else 0
    return tuple(reversed(sizes))


@dataclass(frozen=True)
class WorkloadDistribution:
    """Images per sample and tokens per image as histograms (value -> weight, weights summing to
    one); the largest microbatch memory is planned for is ``max_images_per_microbatch``."""

    images_per_sample: tuple[tuple[int, float], ...]
    # None: each encoder's ``seq_length``
    tokens_per_image: tuple[tuple[int, float], ...] | None
    max_images_per_microbatch: int

    @classmethod
    def of_config(cls, config: OptimusConfig) -> WorkloadDistribution | None:
        """The config's distribution; None when ``data.images_per_sample`` is not given."""
        data = config.data
        if data.images_per_sample is None:
            return None
        tokens = data.tokens_per_image
        return cls(
            tuple(sorted(data.images_per_sample.items())),
            tuple(sorted(tokens.items())) if tokens else None,
            max_images_per_microbatch(config),
        )

    def draw_microbatch(self, config: OptimusConfig, rng: random.Random) -> EncoderWorkload:
        """One microbatch: ``micro_batch_size`` samples' images, capped at the planned maximum;
        its images padded to the longest drawn."""
        counts, weights = zip(*self.images_per_sample)
        images = sum(rng.choices(counts, weights, k=config.training.micro_batch_size))
        images = min(images, self.max_images_per_microbatch)
        if not images:
            return EncoderWorkload.of_images(config, 0)
        tokens = None
        if self.tokens_per_image:
            sizes, size_weights = zip(*self.tokens_per_image)
            tokens = max(rng.choices(sizes, size_weights, k=images))
        return EncoderWorkload.of_images(config, images, tokens)

    def maximum(self, config: OptimusConfig) -> EncoderWorkload:
        """The workload memory is planned for: the most images, each at the most tokens."""
        tokens = max(t for t, _ in self.tokens_per_image) if self.tokens_per_image else None
        return EncoderWorkload.of_images(config, self.max_images_per_microbatch, tokens)

    def mean(self, config: OptimusConfig) -> EncoderWorkload:
        """The mean microbatch, images rounded to the nearest whole one (at least one), at the
        mean tokens per image rounded down to a whole projector merge group."""
        per_sample = sum(n * w for n, w in self.images_per_sample)
        images = max(1, round(per_sample * config.training.micro_batch_size))
        images = min(images, self.max_images_per_microbatch)
        if not self.tokens_per_image:
            return EncoderWorkload.of_images(config, images)
        merge = config.encoders[0].merged_tokens
        tokens = sum(t * w for t, w in self.tokens_per_image)
        return EncoderWorkload.of_images(config, images, max(merge, int(tokens) // merge * merge))


def max_images_per_microbatch(config: OptimusConfig) -> int:
    """``data.max_images_per_microbatch``, or today's one image per sample."""
    stated = config.data.max_images_per_microbatch
    return stated if stated is not None else config.training.micro_batch_size


def draw_iterations(
    config: OptimusConfig,
    distribution: WorkloadDistribution,
    iterations: int,
    microbatches: int,
    seed: int,
) -> list[IterationWorkload]:
    """``iterations`` iterations of ``microbatches`` microbatches each, drawn from
    ``distribution``; the same seed gives the same iterations."""
    rng = random.Random(seed)
    return [
        tuple(distribution.draw_microbatch(config, rng) for _ in range(microbatches))
        for _ in range(iterations)
    ]


def check_within(
    workload: IterationWorkload, maximum: EncoderWorkload, config: OptimusConfig
) -> None:
    """Refuse, before the step, a batch above the maximum memory is planned for: one line naming
    the microbatch and the field.

    Raises:
        OptimusError: a microbatch runs more images, or longer ones, than ``maximum``.
    """
    for i, microbatch in enumerate(workload):
        if maximum.covers(microbatch):
            continue
        for enc, most, load in zip(config.encoders, maximum.loads, microbatch.loads):
            if load.images > most.images:
                raise OptimusError(
                    f"data microbatch {i}: {load.images} images for encoder '{enc.name}', above "
                    f"data.max_images_per_microbatch={most.images}; raise it (memory is planned "
                    "for it) or split the sample's images"
                )
            if load.images and load.tokens_per_image > most.tokens_per_image:
                raise OptimusError(
                    f"data microbatch {i}: images of {load.tokens_per_image} tokens for encoder "
                    f"'{enc.name}', above the {most.tokens_per_image} memory is planned for "
                    "(data.tokens_per_image, the encoder's seq_length); resize the images"
                )
