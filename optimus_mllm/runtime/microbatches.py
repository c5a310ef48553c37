"""The three numberings of one iteration's microbatches, converted here and nowhere else.

- an LLM pipeline's own (``microbatch``): 0 .. num_microbatches - 1, the order megatron-core's
  schedule runs them in on this LLM data-parallel replica;
- an encoder pipeline's own (``EncoderMicrobatch``: its ``local_microbatch`` of
  ``encoder_pipeline``), numbered within the encoder pipelines that feed one LLM pipeline; the
  schedule artifact's ``assignment`` (the paper's global ordering) maps one to the other;
- the job's (``global_index``): which sample the microbatch is, and what seeds its dropout, the same
  under every plan and runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optimus_mllm.scheduler.artifact_format import EncoderMicrobatch


@dataclass(frozen=True)
class MicrobatchNumbering:
    num_microbatches: int  # per LLM pipeline
    llm_dp: int  # this rank's LLM data-parallel replica
    # per LLM microbatch, the encoder microbatch that feeds it; empty without encoder pipelines
    assignment: tuple[EncoderMicrobatch, ...] = ()
    _llm: dict[EncoderMicrobatch, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_llm", {a: i for i, a in enumerate(self.assignment)})

    def global_index(self, microbatch: int) -> int:
        """The job's number of this replica's LLM microbatch ``microbatch``."""
        return self.llm_dp * self.num_microbatches + microbatch

    def encoder(self, microbatch: int) -> EncoderMicrobatch:
        """The encoder microbatch that feeds LLM microbatch ``microbatch``."""
        return self.assignment[microbatch]

    def llm(self, encoder_pipeline: int, local_microbatch: int) -> int:
        """The LLM microbatch that encoder pipeline ``encoder_pipeline``'s ``local_microbatch``
        feeds."""
        return self._llm[EncoderMicrobatch(encoder_pipeline, local_microbatch)]
