"""Encoder process groups beside megatron-core's LLM groups: the rank layout (pure), megatron-core's
rank order, and the groups and encoder-to-LLM links on real gloo ranks.

megatron-core is imported inside the functions that use it: every spawned rank imports this module,
and megatron-core's import costs each of them seconds on a shared 2-core machine."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

from optimus_mllm.planner.plans import ParallelPlan, encoder_stage_gpus
from optimus_mllm.runtime.process_groups import (
    EncoderRankLayout,
    build_encoder_process_groups,
    build_encoder_rank_layout,
    llm_coords,
    megatron_rank,
)

from support.distributed_utils import run_distributed
from support.paths import REPO

RANK_TIMEOUT_S = 120.0  # hard limit; the runs take 10-20 s on 2 shared cores

FIG5_LLM, FIG5_ENC = ParallelPlan(dp=1, pp=4, tp=2), ParallelPlan(dp=2, pp=2, tp=2)

PLAN_PAIRS = [
    pytest.param(FIG5_LLM, FIG5_ENC, id="fig5"),
    pytest.param(ParallelPlan(2, 2, 2), ParallelPlan(4, 1, 2), id="llm-dp2-enc-pp1"),
    pytest.param(ParallelPlan(2, 4, 2), ParallelPlan(8, 2, 1), id="llm-dp2-enc-tp1"),
    pytest.param(ParallelPlan(1, 4, 4), ParallelPlan(8, 2, 1), id="enc-tp1-of-4"),
    pytest.param(ParallelPlan(3, 2, 4), ParallelPlan(6, 2, 2), id="llm-dp3-enc-tp2-of-4"),
    pytest.param(ParallelPlan(1, 2, 2), ParallelPlan(4, 1, 1), id="enc-dp4"),
    pytest.param(ParallelPlan(2, 2, 1), ParallelPlan(2, 2, 1), id="same-plan"),
]


# --- megatron-core's rank order ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "dp", "pp"), [(2, 1, 2), (1, 2, 2), (2, 2, 2), (2, 3, 4), (4, 2, 1)]
)
def test_megatron_rank_matches_megatron_core_rank_generator(tp: int, dp: int, pp: int) -> None:
    from megatron.core import parallel_state

    plan = ParallelPlan(dp=dp, pp=pp, tp=tp)
    generator = parallel_state.RankGenerator(
        tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    for axis, size in {"tp": tp, "dp": dp, "pp": pp}.items():
        expected = {
            tuple(
                megatron_rank(plan, **{**vars(llm_coords(plan, rank)), axis: i})
                for i in range(size)
            )
            for rank in range(plan.world_size)
        }
        assert {tuple(group) for group in generator.get_ranks(axis)} == expected, axis


def test_llm_coords_inverts_megatron_rank() -> None:
    plan = ParallelPlan(dp=3, pp=2, tp=4)
    for rank in range(plan.world_size):
        assert megatron_rank(plan, **vars(llm_coords(plan, rank))) == rank


# --- the pure layout -----------------------------------------------------------------------------


@pytest.mark.parametrize(("llm", "enc"), PLAN_PAIRS)
def test_every_rank_is_in_exactly_one_group_of_each_kind(
    llm: ParallelPlan, enc: ParallelPlan
) -> None:
    layout = build_encoder_rank_layout(llm, enc)
    for groups, size in [
        (layout.tp_groups, enc.tp),
        (layout.pp_groups, enc.pp),
        (layout.dp_groups, enc.dp),
    ]:
        assert all(len(group) == size for group in groups)
        assert Counter(rank for group in groups for rank in group) == Counter(range(llm.world_size))


@pytest.mark.parametrize(("llm", "enc"), PLAN_PAIRS)
def test_groups_agree_with_encoder_coordinates(llm: ParallelPlan, enc: ParallelPlan) -> None:
    layout = build_encoder_rank_layout(llm, enc)
    coords = [c.encoder for c in layout.coords]
    for rank in range(llm.world_size):
        mine = coords[rank]
        assert [coords[r].tp for r in layout.tp_group_of(rank)] == list(range(enc.tp))
        assert [coords[r].pp for r in layout.pp_group_of(rank)] == list(range(enc.pp))
        assert [coords[r].dp for r in layout.dp_group_of(rank)] == list(range(enc.dp))
        assert {(coords[r].dp, coords[r].pp) for r in layout.tp_group_of(rank)} == {
            (mine.dp, mine.pp)
        }
        assert {(coords[r].dp, coords[r].tp) for r in layout.pp_group_of(rank)} == {
            (mine.dp, mine.tp)
        }
        assert {(coords[r].pp, coords[r].tp) for r in layout.dp_group_of(rank)} == {
            (mine.pp, mine.tp)
        }


@pytest.mark.parametrize(("llm", "enc"), PLAN_PAIRS)
def test_stages_sit_on_the_llm_stages_of_encoder_stage_gpus(
    llm: ParallelPlan, enc: ParallelPlan
) -> None:
    layout = build_encoder_rank_layout(llm, enc)
    placement = encoder_stage_gpus(llm, enc)
    q = llm.tp // enc.tp
    m = enc.dp // llm.dp
    for pipe in layout.pipelines:
        assert pipe.encoder_dp == pipe.llm_dp * m + pipe.pipeline
        block = pipe.pipeline // q
        for e, ranks in enumerate(pipe.stage_ranks):
            coords = [layout.coords[r] for r in ranks]
            assert [c.gpu for c in coords] == placement[pipe.pipeline][e]
            assert {(c.llm.dp, c.llm.pp) for c in coords} == {(pipe.llm_dp, block * enc.pp + e)}
            assert all(c.encoder.pipeline == pipe.pipeline for c in coords)
        first = [layout.coords[r].llm for r in pipe.llm_first_stage_ranks]
        assert [(c.dp, c.pp, c.tp) for c in first] == [(pipe.llm_dp, 0, t) for t in range(llm.tp)]


def test_figure5_encoder_pipeline_0_on_gpus_0_to_3_and_pipeline_1_on_4_to_7() -> None:
    layout = build_encoder_rank_layout(FIG5_LLM, FIG5_ENC)

    assert [pipe.stage_ranks for pipe in layout.pipelines] == [((0, 1), (2, 3)), ((4, 5), (6, 7))]
    assert layout.dp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert [(c.encoder.dp, c.encoder.pp, c.encoder.tp) for c in layout.coords] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    assert [(link.encoder_rank, link.llm_rank) for link in layout.links_to(0)] == [(2, 0), (6, 0)]
    assert [(link.encoder_rank, link.llm_rank) for link in layout.links_to(1)] == [(3, 1), (7, 1)]


def test_llm_dp2_puts_each_replicas_encoders_on_its_own_noncontiguous_ranks() -> None:
    # megatron-core: rank = tp + 2*dp + 4*pp, so replica 0 is ranks 0,1 (stage 0) and 4,5 (stage 1)
    layout = build_encoder_rank_layout(ParallelPlan(2, 2, 2), ParallelPlan(4, 1, 2))

    assert [
        (p.encoder_dp, p.llm_dp, p.stage_ranks, p.llm_first_stage_ranks) for p in layout.pipelines
    ] == [
        (0, 0, ((0, 1),), (0, 1)),
        (1, 0, ((4, 5),), (0, 1)),
        (2, 1, ((2, 3),), (2, 3)),
        (3, 1, ((6, 7),), (2, 3)),
    ]
    assert layout.dp_groups == ((0, 4, 2, 6), (1, 5, 3, 7))


@pytest.mark.parametrize(("llm", "enc"), PLAN_PAIRS)
def test_every_llm_first_stage_rank_gets_every_encoder_pipeline_of_its_replica(
    llm: ParallelPlan, enc: ParallelPlan
) -> None:
    layout = build_encoder_rank_layout(llm, enc)
    for c in layout.coords:
        links = layout.links_to(c.rank)
        if c.llm.pp != 0:
            assert links == ()
            continue
        replica = [p for p in layout.pipelines if p.llm_dp == c.llm.dp]
        assert [link.encoder_dp for link in links] == [p.encoder_dp for p in replica]
        # LLM TP rank t takes the embeddings from encoder TP rank t % TP_enc
        assert [link.encoder_rank for link in links] == [
            p.last_stage_ranks[c.llm.tp % enc.tp] for p in replica
        ]


@pytest.mark.parametrize(("llm", "enc"), PLAN_PAIRS)
def test_each_encoder_last_stage_rank_sends_to_q_llm_ranks_and_gets_one_gradient(
    llm: ParallelPlan, enc: ParallelPlan
) -> None:
    layout = build_encoder_rank_layout(llm, enc)
    for c in layout.coords:
        links = layout.links_from(c.rank)
        if c.encoder.pp != enc.pp - 1:
            assert links == ()
            continue
        assert len(links) == llm.tp // enc.tp
        assert {link.encoder_dp for link in links} == {c.encoder.dp}
        assert {layout.coords[link.llm_rank].llm.tp % enc.tp for link in links} == {c.encoder.tp}
        assert sum(link.carries_gradient for link in links) == 1


def test_tp_enc_below_tp_llm_gives_each_slot_its_own_gradient_sender() -> None:
    layout = build_encoder_rank_layout(ParallelPlan(1, 4, 4), ParallelPlan(8, 2, 1))
    senders = {link.encoder_dp: link.llm_rank for link in layout.links if link.carries_gradient}
    # pipelines j = block * 4 + slot; LLM stage-0 ranks are 0..3, slot s returns via rank s
    assert senders == {j: j % 4 for j in range(8)}
    assert layout.pipelines[5].stage_ranks == ((9,), (13,))


def test_encoder_pp1_on_the_first_llm_stage_is_a_local_copy() -> None:
    layout = build_encoder_rank_layout(ParallelPlan(1, 2, 2), ParallelPlan(4, 1, 1))
    on_stage0 = [p for p in layout.pipelines if layout.coords[p.last_stage_ranks[0]].llm.pp == 0]

    assert [p.stage_ranks for p in on_stage0] == [((0,),), ((1,),)]
    for pipe in on_stage0:
        (gradient,) = [
            link
            for link in layout.links
            if link.encoder_dp == pipe.encoder_dp and link.carries_gradient
        ]
        assert gradient.local
    assert not any(
        link.local for link in layout.links if layout.coords[link.encoder_rank].llm.pp == 1
    )


@pytest.mark.parametrize(("llm", "enc"), PLAN_PAIRS)
def test_channels_one_per_message_kind_and_direction(llm: ParallelPlan, enc: ParallelPlan) -> None:
    """Every encoder stage edge (per TP lane, both ways) and every non-local link has its own
    channel."""
    layout = build_encoder_rank_layout(llm, enc)
    channels = layout.channels
    assert len(set(channels)) == len(channels)
    assert all(c.sender != c.receiver for c in channels)
    expected = {
        ("embeddings", link.encoder_rank, link.llm_rank) for link in layout.links if not link.local
    }
    expected |= {
        ("embeddings_grad", link.llm_rank, link.encoder_rank)
        for link in layout.links
        if not link.local and link.carries_gradient
    }
    for pipe in layout.pipelines:
        for here, there in zip(pipe.stage_ranks, pipe.stage_ranks[1:]):
            expected |= {("activation", a, b) for a, b in zip(here, there)}
            expected |= {("activation_grad", b, a) for a, b in zip(here, there)}
    assert {(c.kind, c.sender, c.receiver) for c in channels} == expected


@pytest.mark.parametrize(
    ("llm", "enc"),
    [
        (ParallelPlan(1, 4, 2), ParallelPlan(1, 4, 1)),  # different world size
        (ParallelPlan(1, 4, 2), ParallelPlan(1, 3, 2)),  # PP_enc does not divide PP_llm (and size)
        (ParallelPlan(1, 4, 2), ParallelPlan(2, 1, 4)),  # TP_enc > TP_llm
        (ParallelPlan(2, 2, 2), ParallelPlan(1, 4, 2)),  # PP_enc > PP_llm, DP_enc < DP_llm
    ],
)
def test_plans_that_do_not_tile_the_llm_are_rejected(llm: ParallelPlan, enc: ParallelPlan) -> None:
    with pytest.raises(ValueError):
        build_encoder_rank_layout(llm, enc)


def test_the_layout_does_not_import_torch() -> None:
    code = "import sys, optimus_mllm.runtime.process_groups; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- gloo ranks ----------------------------------------------------------------------------------

Cases = list[tuple[ParallelPlan, list[ParallelPlan]]]  # an LLM plan and encoder plans beside it


def _megatron_view() -> dict[str, Any]:
    from megatron.core import parallel_state

    groups = {
        "tp": parallel_state.get_tensor_model_parallel_group(),
        "pp": parallel_state.get_pipeline_model_parallel_group(),
        "dp": parallel_state.get_data_parallel_group(),
    }
    return {
        "coords": (
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
        ),
        "groups": {name: tuple(dist.get_process_group_ranks(g)) for name, g in groups.items()},
    }


def _exchange(layout: EncoderRankLayout, rank: int) -> dict[str, Any]:
    """Group all-reduces of the rank, and every P2P of the layout carrying the sender's rank."""
    pgs = build_encoder_process_groups(layout, rank)
    sums = {}
    for name, group in [("tp", pgs.tp_group), ("pp", pgs.pp_group), ("dp", pgs.dp_group)]:
        value = torch.tensor([rank])
        dist.all_reduce(value, group=group)
        sums[name] = int(value)
    # one message per channel, on the channel's own group (no tags): it must arrive from its sender
    sends = [c for c in pgs.channels if c.sender == rank]
    recvs = [c for c in pgs.channels if c.receiver == rank]
    buffers = [torch.tensor([-1]) for _ in recvs]
    works = [dist.isend(torch.tensor([rank]), c.receiver, group=pgs.channels[c]) for c in sends]
    works += [dist.irecv(buf, c.sender, group=pgs.channels[c]) for buf, c in zip(buffers, recvs)]
    for work in works:
        work.wait()
    return {
        "sums": sums,
        "ranks": {"tp": pgs.tp_ranks, "pp": pgs.pp_ranks, "dp": pgs.dp_ranks},
        "received": [(c.sender, int(buf)) for buf, c in zip(buffers, recvs)],
        "channels": sorted(
            (c.kind, c.sender, c.receiver, tuple(dist.get_process_group_ranks(g)))
            for c, g in pgs.channels.items()
        ),
    }


def _encoder_results(llm: ParallelPlan, enc_plans: list[ParallelPlan]) -> list[dict[str, Any]]:
    return [_exchange(build_encoder_rank_layout(llm, enc), dist.get_rank()) for enc in enc_plans]


def _rank_with_megatron(cases: Cases) -> list[dict[str, Any]]:
    """Per case: megatron-core's LLM groups, then the encoder groups of each plan beside them."""
    from megatron.core import parallel_state

    results = []
    for llm, enc_plans in cases:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=llm.tp, pipeline_model_parallel_size=llm.pp
        )
        results.append({"megatron": _megatron_view(), "encoders": _encoder_results(llm, enc_plans)})
        parallel_state.destroy_model_parallel()
    return results


def _rank_without_megatron(cases: Cases) -> list[dict[str, Any]]:
    return [
        {"megatron": None, "encoders": _encoder_results(llm, enc_plans)} for llm, enc_plans in cases
    ]


def _check(cases: Cases, per_rank: list[list[dict[str, Any]]]) -> None:
    for index, (llm, enc_plans) in enumerate(cases):
        for rank, results in enumerate(per_rank):
            if results[index]["megatron"] is not None:
                _check_megatron(llm, rank, results[index]["megatron"])
            for enc, exchange in zip(enc_plans, results[index]["encoders"]):
                _check_exchange(build_encoder_rank_layout(llm, enc), rank, exchange)


def _check_megatron(llm: ParallelPlan, rank: int, view: dict[str, Any]) -> None:
    c = llm_coords(llm, rank)
    assert view["coords"] == (c.dp, c.pp, c.tp), (
        f"rank {rank}: megatron-core orders ranks differently"
    )
    assert view["groups"] == {
        "tp": tuple(megatron_rank(llm, c.dp, c.pp, t) for t in range(llm.tp)),
        "pp": tuple(megatron_rank(llm, c.dp, s, c.tp) for s in range(llm.pp)),
        "dp": tuple(megatron_rank(llm, d, c.pp, c.tp) for d in range(llm.dp)),
    }


def _check_exchange(layout: EncoderRankLayout, rank: int, exchange: dict[str, Any]) -> None:
    groups = {
        "tp": layout.tp_group_of(rank),
        "pp": layout.pp_group_of(rank),
        "dp": layout.dp_group_of(rank),
    }
    assert exchange["ranks"] == groups
    assert exchange["sums"] == {name: sum(ranks) for name, ranks in groups.items()}
    assert all(peer == value for peer, value in exchange["received"]), exchange["received"]
    mine = [c for c in layout.channels if rank in (c.sender, c.receiver)]
    assert exchange["channels"] == sorted(
        (c.kind, c.sender, c.receiver, tuple(sorted((c.sender, c.receiver)))) for c in mine
    )


@pytest.mark.distributed
def test_four_ranks_megatron_llm_groups_and_encoder_groups() -> None:
    # LLM TP2 PP2 (DP1) and TP1 PP2 (DP2, which pins megatron-core's DP order)
    enc_plans = [ParallelPlan(dp=4, pp=1, tp=1), ParallelPlan(dp=2, pp=2, tp=1)]
    cases = [
        (ParallelPlan(dp=1, pp=2, tp=2), enc_plans),
        (ParallelPlan(dp=2, pp=2, tp=1), enc_plans),
    ]
    _check(cases, run_distributed(_rank_with_megatron, 4, cases, timeout=RANK_TIMEOUT_S))


@pytest.mark.distributed
def test_eight_ranks_figure5_encoder_groups() -> None:
    # without megatron-core: its import on 8 ranks would double this test's time
    cases = [(FIG5_LLM, [FIG5_ENC])]
    _check(cases, run_distributed(_rank_without_megatron, 8, cases, timeout=RANK_TIMEOUT_S))
