"""Parallel plans and where the encoder pipelines sit inside one LLM pipeline (paper Fig. 5)."""

from __future__ import annotations

from dataclasses import dataclass

from optimus_mllm.config import TPMode


@dataclass(frozen=True)
class ParallelPlan:
    """A 3D plan: data-, pipeline- and tensor-parallel sizes, model chunks per pipeline rank, and
    how the ``tp`` ranks split each layer (``tp_mode``, of total degree ``tp``)."""

    dp: int
    pp: int
    tp: int
    vp: int = 1
    tp_mode: TPMode = "1d"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        text = f"DP{self.dp} PP{self.pp} TP{self.tp}"
        text += f" V{self.vp}" if self.vp > 1 else ""
        return text + (f" {self.tp_mode}" if self.tp_mode != "1d" else "")

    def as_dict(self) -> dict[str, int | str]:
        """The sizes; the TP mode where it is not 1d, so that a 1D plan reads as it always has."""
        sizes: dict[str, int | str] = {"dp": self.dp, "pp": self.pp, "tp": self.tp, "vp": self.vp}
        return sizes | ({"tp_mode": self.tp_mode} if self.tp_mode != "1d" else {})


def encoder_pipelines_per_llm_pipeline(llm: ParallelPlan, enc: ParallelPlan) -> int:
    """m = DP_enc / DP_llm: how many encoder pipelines share the GPUs of one LLM pipeline."""
    return enc.dp // llm.dp


def encoder_stage_gpus(llm: ParallelPlan, enc: ParallelPlan) -> list[list[list[int]]]:
    """GPU indices (within one LLM pipeline) of every encoder pipeline's every stage.

    GPUs of an LLM pipeline are numbered ``llm_stage * TP_llm + tp_rank``. Encoder pipeline
    ``j = block * q + slot`` (``q = TP_llm / TP_enc``) runs its stage ``e`` on LLM stage
    ``block * PP_enc + e``, on TP ranks ``slot * TP_enc ... (slot + 1) * TP_enc - 1``: consecutive
    LLM stages, as in the paper's Figure 5, so encoder P2P stays between neighbouring stages.
    """
    q = llm.tp // enc.tp
    blocks = llm.pp // enc.pp
    layout = []
    for block in range(blocks):
        for slot in range(q):
            stages = []
            for e in range(enc.pp):
                llm_stage = block * enc.pp + e
                stages.append([llm_stage * llm.tp + slot * enc.tp + r for r in range(enc.tp)])
            layout.append(stages)
    return layout


def symmetry_groups(llm: ParallelPlan, enc: ParallelPlan) -> list[int]:
    """Sizes of the groups of interchangeable encoder pipelines, in pipeline order.

    Pipelines that differ only in their TP slot run on the same LLM stages, whose TP ranks all see
    the same LLM timeline, so swapping their microbatch counts gives the same schedule.
    """
    return [llm.tp // enc.tp] * (llm.pp // enc.pp)
