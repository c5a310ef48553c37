"""The numberings of one iteration's microbatches, converted here and nowhere else.

- an LLM pipeline's own (``microbatch``, an LLM position): 0 .. num_microbatches - 1, the order
  megatron-core's schedule runs them in on this LLM data-parallel replica;
- the replica's data order: LLM position i runs data microbatch ``llm_order[i]`` (a per-iteration
  schedule runs the imageless ones first; the identity otherwise);
- an encoder pipeline's own (``EncoderMicrobatch``: its ``local_microbatch`` of
  ``encoder_pipeline``), numbered within the encoder pipelines that feed one LLM pipeline; the
  schedule artifact's ``assignment`` (the paper's global ordering) lists them by encoder microbatch
  and ``feeds`` maps each to the LLM position it feeds: none for an imageless microbatch, one, or
  several that run its images in parts (``part``: their order among that position's feeders);
- the job's (``global_index``): which sample the microbatch is, and what seeds its dropout, the same
  under every plan, runtime and order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from optimus_mllm.scheduler.artifact_format import EncoderMicrobatch, ScheduleArtifact


@dataclass(frozen=True)
class MicrobatchNumbering:
    num_microbatches: int  # per LLM pipeline
    llm_dp: int  # this rank's LLM data-parallel replica
    # per encoder microbatch (global ordering); empty without encoder pipelines
    assignment: tuple[EncoderMicrobatch, ...] = ()
    # per encoder microbatch: the LLM position it feeds; empty: encoder microbatch i feeds i
    feeds: tuple[int, ...] = ()
    # per LLM position: the data microbatch it runs; empty: data order
    llm_order: tuple[int, ...] = ()
    # the most images of one encoder microbatch; None: all of its LLM position's
    images_per_chain: int | None = None
    _fed: dict[EncoderMicrobatch, tuple[int, int]] = field(init=False, repr=False, compare=False)
    _feeders: dict[int, tuple[EncoderMicrobatch, ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        feeds = self.feeds or tuple(range(len(self.assignment)))
        feeders: dict[int, list[EncoderMicrobatch]] = defaultdict(list)
        fed = {}
        for source, i in zip(self.assignment, feeds):
            fed[source] = (i, len(feeders[i]))
            feeders[i].append(source)
        object.__setattr__(self, "_fed", fed)
        object.__setattr__(self, "_feeders", {i: tuple(s) for i, s in feeders.items()})

    @classmethod
    def of_artifact(
        cls, artifact: ScheduleArtifact, num_microbatches: int, llm_dp: int
    ) -> MicrobatchNumbering:
        """The numbering a step under ``artifact`` runs with."""
        return cls(
            num_microbatches,
            llm_dp,
            artifact.assignment,
            artifact.feeds,
            artifact.llm_order,
            artifact.images_per_chain,
        )

    def data_microbatch(self, microbatch: int) -> int:
        """The data microbatch (this replica's, in data order) LLM position ``microbatch`` runs."""
        return self.llm_order[microbatch] if self.llm_order else microbatch

    def global_index(self, microbatch: int) -> int:
        """The job's number of the microbatch this replica's LLM position ``microbatch`` runs."""
        return self.llm_dp * self.num_microbatches + self.data_microbatch(microbatch)

    def feeders(self, microbatch: int) -> tuple[EncoderMicrobatch, ...]:
        """The encoder microbatches that feed LLM position ``microbatch``, its images in that
        order; none for a microbatch the schedule gave no encoder work."""
        return self._feeders.get(microbatch, ())

    def llm(self, encoder_pipeline: int, local_microbatch: int) -> int:
        """The LLM position that encoder pipeline ``encoder_pipeline``'s ``local_microbatch``
        feeds."""
        return self._fed[EncoderMicrobatch(encoder_pipeline, local_microbatch)][0]

    def part(self, encoder_pipeline: int, local_microbatch: int) -> int:
        """Which of its LLM position's feeders that local microbatch is (0: the first images)."""
        return self._fed[EncoderMicrobatch(encoder_pipeline, local_microbatch)][1]

    def chain_images(self, encoder_pipeline: int, local_microbatch: int, images: int) -> range:
        """The images (positions among its LLM position's ``images``, in order) that encoder
        pipeline ``encoder_pipeline``'s ``local_microbatch`` runs; empty where it has none."""
        if self.images_per_chain is None:
            return range(images)
        lo = self.part(encoder_pipeline, local_microbatch) * self.images_per_chain
        return range(min(lo, images), min(lo + self.images_per_chain, images))

    def images_fed(self, microbatch: int, images: int) -> int:
        """How many of LLM position ``microbatch``'s ``images`` its feeders run together."""
        feeders = len(self.feeders(microbatch))
        if self.images_per_chain is None:
            return images if feeders else 0
        return min(images, feeders * self.images_per_chain)
