"""Process groups of the encoder's parallel plan on the same ranks as the LLM's (paper §3.1, Fig.
5).

Rank order. The LLM's groups come from megatron-core's ``initialize_model_parallel`` with its
default order ``tp-cp-ep-dp-pp`` (CP = EP = 1 here): TP fastest, then DP, then PP, so
``rank = tp + TP * dp + TP * DP * pp`` (checked against megatron-core in the tests). GPU ``g`` of
LLM pipeline ``dp`` (``g = llm_stage * TP_llm + tp``, the numbering of ``encoder_stage_gpus``) is
therefore global rank ``g % TP_llm + TP_llm * dp + TP_llm * DP_llm * (g // TP_llm)``: one LLM
pipeline's GPUs are not contiguous ranks once DP_llm > 1.

Encoder placement. Inside every LLM pipeline ``dp`` sit m = DP_enc / DP_llm encoder pipelines,
placed by ``encoder_stage_gpus``; pipeline ``j`` there has encoder DP index ``dp * m + j``.

Encoder-to-LLM transfer. The encoder's last stage holds the image embeddings of a microbatch
whole on each of its TP_enc ranks (the projector output is gathered, never sequence-sharded), and
every TP rank of the LLM's first stage needs them whole. So LLM stage-0 TP rank ``t`` receives
encoder pipeline ``j``'s embeddings from that pipeline's last-stage TP rank ``t % TP_enc``; each
encoder last-stage rank sends to TP_llm / TP_enc LLM ranks. The gradient of the embeddings is the
same on every LLM TP rank (megatron-core all-reduces it in the first layer's backward), so only one
LLM rank returns it to each encoder rank: encoder TP rank ``r`` of a pipeline in TP slot ``s``
(see ``encoder_stage_gpus``) receives it from LLM TP rank ``s * TP_enc + r``. Both choices make the
transfer a local copy whenever an encoder last stage sits on the LLM's first stage (PP_enc = 1).

The layout is pure arithmetic; only ``build_encoder_process_groups`` touches ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from optimus_mllm.planner.plans import (
    ParallelPlan,
    encoder_pipelines_per_llm_pipeline,
    encoder_stage_gpus,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class LLMCoords:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class EncoderCoords:
    dp: int  # global encoder DP index: llm_dp * m + pipeline
    pp: int
    tp: int
    pipeline: int  # encoder pipeline within its LLM pipeline, as in encoder_stage_gpus


@dataclass(frozen=True)
class RankCoords:
    rank: int
    gpu: int  # index within its LLM pipeline: llm_stage * TP_llm + tp
    llm: LLMCoords
    encoder: EncoderCoords


@dataclass(frozen=True)
class EncoderLLMLink:
    """Encoder pipeline ``encoder_dp``'s last-stage rank sends its embeddings to one LLM stage-0
    rank.

    With ``carries_gradient`` the LLM rank also returns the embeddings' gradient over this link.
    """

    encoder_dp: int
    encoder_rank: int
    llm_rank: int
    carries_gradient: bool

    @property
    def local(self) -> bool:
        return self.encoder_rank == self.llm_rank


@dataclass(frozen=True)
class Channel:
    """One kind of message from one rank to another, on a two-rank process group of its own.

    A group per channel makes every group carry messages of one kind in one direction, matched by
    order alone: NCCL's rule (it ignores tags), and no two opposing sends on one communicator.
    """

    # "activation" / "activation_grad" between encoder stages, "embeddings" / "embeddings_grad"
    kind: str
    sender: int
    receiver: int


@dataclass(frozen=True)
class EncoderPipeline:
    encoder_dp: int
    llm_dp: int
    pipeline: int  # within its LLM pipeline
    stage_ranks: tuple[Ranks, ...]  # per encoder stage, in encoder TP order
    llm_first_stage_ranks: Ranks  # the LLM stage-0 ranks of the same replica, in LLM TP order

    @property
    def last_stage_ranks(self) -> Ranks:
        return self.stage_ranks[-1]


@dataclass(frozen=True)
class EncoderRankLayout:
    """Every rank's LLM and encoder coordinates, the encoder's groups and the transfer links.

    Groups are listed in a fixed order (the order ``torch.distributed.new_group`` is called in):
    TP groups by (encoder dp, stage), PP groups by (encoder dp, encoder tp), DP groups by
    (stage, encoder tp), model-parallel groups (one encoder pipeline's ranks, for the optimizer's
    gradient norm) by encoder dp; each group's ranks in TP, stage, DP or stage-then-TP order.
    """

    llm_plan: ParallelPlan
    enc_plan: ParallelPlan
    coords: tuple[RankCoords, ...]  # indexed by global rank
    tp_groups: tuple[Ranks, ...]
    pp_groups: tuple[Ranks, ...]
    dp_groups: tuple[Ranks, ...]
    mp_groups: tuple[Ranks, ...]
    pipelines: tuple[EncoderPipeline, ...]  # indexed by encoder DP index
    links: tuple[EncoderLLMLink, ...]
    channels: tuple[Channel, ...]  # every rank-to-rank message kind, in group creation order

    def tp_group_of(self, rank: int) -> Ranks:
        return _group_containing(self.tp_groups, rank)

    def pp_group_of(self, rank: int) -> Ranks:
        return _group_containing(self.pp_groups, rank)

    def dp_group_of(self, rank: int) -> Ranks:
        return _group_containing(self.dp_groups, rank)

    def links_from(self, encoder_rank: int) -> tuple[EncoderLLMLink, ...]:
        """Where an encoder last-stage rank sends its embeddings (empty for other ranks)."""
        return tuple(link for link in self.links if link.encoder_rank == encoder_rank)

    def links_to(self, llm_rank: int) -> tuple[EncoderLLMLink, ...]:
        """The encoder ranks feeding an LLM stage-0 rank, one per encoder pipeline of its
        replica."""
        return tuple(link for link in self.links if link.llm_rank == llm_rank)


def megatron_rank(plan: ParallelPlan, dp: int, pp: int, tp: int) -> int:
    """Global rank of LLM coordinates under megatron-core's default order tp-cp-ep-dp-pp."""
    return tp + plan.tp * dp + plan.tp * plan.dp * pp


def llm_coords(plan: ParallelPlan, rank: int) -> LLMCoords:
    """Inverse of ``megatron_rank``."""
    dp, tp = divmod(rank % (plan.tp * plan.dp), plan.tp)
    return LLMCoords(dp=dp, pp=rank // (plan.tp * plan.dp), tp=tp)


def check_colocatable(llm: ParallelPlan, enc: ParallelPlan) -> None:
    """Raise ValueError unless the encoder plan tiles the LLM's GPUs as in Figure 5."""
    if enc.world_size != llm.world_size:
        raise ValueError(f"encoder plan {enc} and LLM plan {llm} use different numbers of GPUs")
    if llm.pp % enc.pp or llm.tp % enc.tp or enc.dp % llm.dp:
        raise ValueError(
            f"encoder plan {enc} needs PP_enc | PP_llm and TP_enc | TP_llm for LLM plan {llm}"
        )


def build_encoder_rank_layout(llm: ParallelPlan, enc: ParallelPlan) -> EncoderRankLayout:
    """The encoder plan ``enc`` placed on the ranks of megatron-core's LLM plan ``llm``."""
    check_colocatable(llm, enc)
    pipelines = _encoder_pipelines(llm, enc)
    by_rank = {
        rank: _rank_coords(llm, pipe, stage, tp, rank)
        for pipe in pipelines
        for stage, ranks in enumerate(pipe.stage_ranks)
        for tp, rank in enumerate(ranks)
    }
    links = tuple(link for pipe in pipelines for link in _links(llm, enc, pipe))
    return EncoderRankLayout(
        llm_plan=llm,
        enc_plan=enc,
        coords=tuple(by_rank[rank] for rank in range(llm.world_size)),
        tp_groups=tuple(ranks for pipe in pipelines for ranks in pipe.stage_ranks),
        pp_groups=tuple(
            tuple(ranks[tp] for ranks in pipe.stage_ranks)
            for pipe in pipelines
            for tp in range(enc.tp)
        ),
        dp_groups=tuple(
            tuple(pipe.stage_ranks[stage][tp] for pipe in pipelines)
            for stage in range(enc.pp)
            for tp in range(enc.tp)
        ),
        mp_groups=tuple(
            tuple(rank for ranks in pipe.stage_ranks for rank in ranks) for pipe in pipelines
        ),
        pipelines=pipelines,
        links=links,
        channels=_channels(pipelines, links),
    )


def _channels(
    pipelines: tuple[EncoderPipeline, ...], links: tuple[EncoderLLMLink, ...]
) -> tuple[Channel, ...]:
    """Activations down each encoder pipeline's TP lanes and their gradients back; embeddings to the
    LLM
    and their gradient back, wherever the two ends are different ranks."""
    channels = []
    for pipe in pipelines:
        for here, there in zip(pipe.stage_ranks, pipe.stage_ranks[1:]):
            for a, b in zip(here, there):
                channels += [Channel("activation", a, b), Channel("activation_grad", b, a)]
    for link in links:
        if not link.local:
            channels.append(Channel("embeddings", link.encoder_rank, link.llm_rank))
            if link.carries_gradient:
                channels.append(Channel("embeddings_grad", link.llm_rank, link.encoder_rank))
    return tuple(channels)


def _encoder_pipelines(llm: ParallelPlan, enc: ParallelPlan) -> tuple[EncoderPipeline, ...]:
    m = encoder_pipelines_per_llm_pipeline(llm, enc)
    placement = encoder_stage_gpus(llm, enc)
    first_stage_gpus = range(llm.tp)
    return tuple(
        EncoderPipeline(
            encoder_dp=llm_dp * m + j,
            llm_dp=llm_dp,
            pipeline=j,
            stage_ranks=tuple(tuple(_gpu_rank(llm, llm_dp, g) for g in gpus) for gpus in stages),
            llm_first_stage_ranks=tuple(_gpu_rank(llm, llm_dp, g) for g in first_stage_gpus),
        )
        for llm_dp in range(llm.dp)
        for j, stages in enumerate(placement)
    )


def _gpu_rank(llm: ParallelPlan, llm_dp: int, gpu: int) -> int:
    return megatron_rank(llm, llm_dp, gpu // llm.tp, gpu % llm.tp)


def _rank_coords(
    llm: ParallelPlan, pipe: EncoderPipeline, stage: int, tp: int, rank: int
) -> RankCoords:
    coords = llm_coords(llm, rank)
    return RankCoords(
        rank=rank,
        gpu=coords.pp * llm.tp + coords.tp,
        llm=coords,
        encoder=EncoderCoords(dp=pipe.encoder_dp, pp=stage, tp=tp, pipeline=pipe.pipeline),
    )


def _links(llm: ParallelPlan, enc: ParallelPlan, pipe: EncoderPipeline) -> list[EncoderLLMLink]:
    slot = pipe.pipeline % (llm.tp // enc.tp)  # pipeline j = block * q + slot (encoder_stage_gpus)
    return [
        EncoderLLMLink(
            encoder_dp=pipe.encoder_dp,
            encoder_rank=pipe.last_stage_ranks[t % enc.tp],
            llm_rank=llm_rank,
            carries_gradient=t // enc.tp == slot,
        )
        for t, llm_rank in enumerate(pipe.llm_first_stage_ranks)
    ]


def _group_containing(groups: tuple[Ranks, ...], rank: int) -> Ranks:
    return next(group for group in groups if rank in group)


@dataclass(frozen=True)
class EncoderProcessGroups:
    """This rank's encoder groups and peers; P2P peers are global ranks of the default group."""

    rank: int
    coords: EncoderCoords
    tp_group: ProcessGroup
    pp_group: ProcessGroup
    dp_group: ProcessGroup
    # dp_group over gloo (itself when gloo is the backend): checkpoint gathers
    dp_group_gloo: ProcessGroup
    mp_group: ProcessGroup  # this rank's encoder pipeline: every stage and TP rank
    tp_ranks: Ranks
    pp_ranks: Ranks
    dp_ranks: Ranks
    prev_stage_rank: int | None  # previous encoder stage; None on the first
    next_stage_rank: int | None  # next encoder stage; None on the last
    embedding_sends: tuple[EncoderLLMLink, ...]  # this rank as encoder last stage
    embedding_recvs: tuple[EncoderLLMLink, ...]  # this rank as LLM stage 0, by encoder DP index
    channels: dict[Channel, ProcessGroup]  # the channels this rank sends or receives on

    @property
    def gradient_recv(self) -> EncoderLLMLink | None:
        """The link the embeddings' gradient comes back over (encoder last stage only)."""
        return next((link for link in self.embedding_sends if link.carries_gradient), None)

    @property
    def gradient_sends(self) -> tuple[EncoderLLMLink, ...]:
        """The encoder ranks this LLM stage-0 rank returns the embeddings' gradient to."""
        return tuple(link for link in self.embedding_recvs if link.carries_gradient)


def build_encoder_process_groups(layout: EncoderRankLayout, rank: int) -> EncoderProcessGroups:
    """Create every encoder group on every rank (a collective call), keep this rank's.

    ``torch.distributed.new_group`` must be called by all ranks for all groups in the same
    order, so every rank calls this with the same ``layout``.
    """
    tp_group, tp_ranks = _create_groups(layout.tp_groups, rank)
    pp_group, pp_ranks = _create_groups(layout.pp_groups, rank)
    dp_group, dp_ranks = _create_groups(layout.dp_groups, rank)
    dp_group_gloo = (
        _create_groups(layout.dp_groups, rank, "gloo")[0] if _backend() != "gloo" else dp_group
    )
    mp_group, _ = _create_groups(layout.mp_groups, rank)
    channels = _create_channel_groups(layout.channels, rank)
    coords = layout.coords[rank].encoder
    return EncoderProcessGroups(
        rank=rank,
        coords=coords,
        tp_group=tp_group,
        pp_group=pp_group,
        dp_group=dp_group,
        dp_group_gloo=dp_group_gloo,
        mp_group=mp_group,
        tp_ranks=tp_ranks,
        pp_ranks=pp_ranks,
        dp_ranks=dp_ranks,
        prev_stage_rank=pp_ranks[coords.pp - 1] if coords.pp > 0 else None,
        next_stage_rank=pp_ranks[coords.pp + 1] if coords.pp + 1 < len(pp_ranks) else None,
        embedding_sends=layout.links_from(rank),
        embedding_recvs=layout.links_to(rank),
        channels=channels,
    )


def _backend() -> str:
    import torch.distributed as dist  # here, so that the layout alone never imports torch

    return dist.get_backend()


def _create_groups(
    groups: tuple[Ranks, ...], rank: int, backend: str | None = None
) -> tuple[ProcessGroup, Ranks]:
    """Call ``new_group`` for every group (all ranks must), return the one holding ``rank``."""
    import torch.distributed as dist

    created = [(dist.new_group(list(ranks), backend=backend), ranks) for ranks in groups]
    return next((group, ranks) for group, ranks in created if rank in ranks)


def _create_channel_groups(channels: tuple[Channel, ...], rank: int) -> dict[Channel, ProcessGroup]:
    """A two-rank group per channel (all ranks create all, in order); this rank's channels."""
    import torch.distributed as dist

    created = {channel: dist.new_group([channel.sender, channel.receiver]) for channel in channels}
    return {
        channel: group
        for channel, group in created.items()
        if rank in (channel.sender, channel.receiver)
    }
