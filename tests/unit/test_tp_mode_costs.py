"""The 2D, 3D and METP layer chains (``cost_model.layer_kernels``) do the layer's FLOPs split
over the ranks and move the papers' communication volumes (2D: Xu et al. Table 1; 3D: Bian et
al. §3.1.2; METP: Liang et al. Tables 1-2)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from optimus_mllm.config import ClusterConfig, CostModelConfig, TransformerSpec
from optimus_mllm.costing.cost_model import (
    CostModel,
    KernelWork,
    LayerShape,
    collective_bytes_on_wire,
    layer_kernels,
    overlap_rows_threshold,
    ring_exposed_share,
)

B, S, H, HEADS = 2, 512, 256, 16
SPEC = TransformerSpec(
    num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=4 * H, seq_length=S
)
BSH, H2 = B * S * H, H * H


def _shape(mode: str, tp: int, recompute: str = "none") -> LayerShape:
    return LayerShape(SPEC, tp, B, True, 2, recompute, tp_mode=mode)


def _elements(kernels: list[KernelWork], prefix: str = "") -> float:
    """Elements one rank sends in the chain's communication kernels named ``prefix``..."""
    return sum(
        collective_bytes_on_wire(k.collective, k.bytes, k.group_size) / 2
        for k in kernels
        if k.is_comm and k.name.removeprefix("recompute_").startswith(prefix)
    )


def _flops(kernels: list[KernelWork]) -> float:
    return sum(k.flops for k in kernels if k.kind in ("gemm", "attention"))


@pytest.mark.parametrize("mode, tp", [("2d", 4), ("2d", 16), ("3d", 8), ("metp", 2), ("metp", 8)])
def test_a_rank_does_its_share_of_the_layer(mode, tp):
    """GEMM and attention FLOPs per rank equal megatron-core's 1D at the same degree (1/t each),
    forward and backward (METP's backward also recomputes the QKV projection and fc1)."""
    one_d = _shape("1d", tp)
    assert _flops(layer_kernels(_shape(mode, tp), "fwd")) == pytest.approx(
        _flops(layer_kernels(one_d, "fwd"))
    )
    recomputed = 2.0 * B * S * H * (3 * H + 4 * H) / tp if mode == "metp" else 0.0
    assert _flops(layer_kernels(_shape(mode, tp), "bwd")) == pytest.approx(
        _flops(layer_kernels(one_d, "bwd")) + recomputed
    )


@pytest.mark.parametrize("q", [2, 4])
def test_2d_volume_is_the_papers_table_1(q):
    """Forward log(p)/(2 sqrt p) (7bsh + 12h^2) at p = q^2; backward with the recomputation the
    paper assumes three times that, (21bsh + 36h^2)."""
    factor = math.log2(q * q) / (2 * q)
    assert _elements(layer_kernels(_shape("2d", q * q), "fwd")) == pytest.approx(
        factor * (7 * BSH + 12 * H2)
    )
    assert _elements(layer_kernels(_shape("2d", q * q, "full"), "bwd")) == pytest.approx(
        factor * (21 * BSH + 36 * H2)
    )


def test_3d_volume_is_the_papers_per_product_volume():
    """Each product C = AB moves (MN + NK + MK) / p^3 per rank to each of p - 1 others, forward
    and again backward: over the layer's four linears (p - 1) / p^3 (16bsh + 12h^2)."""
    p = 2
    volume = (p - 1) / p**3 * (16 * BSH + 12 * H2)
    assert _elements(layer_kernels(_shape("3d", p**3), "fwd")) == pytest.approx(volume)
    assert _elements(layer_kernels(_shape("3d", p**3), "bwd")) == pytest.approx(volume)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_metp_volume_is_the_papers_tables_1_and_2(p):
    """FFN: 24 (p-1)/p h^2 over forward and backward (Table 1); attention: forward
    4 log2(p) h^2 + 2 (p-1)/p bsh, backward 8 log2(p) h^2 + 4 (p-1)/p bsh (Table 2, §4.2)."""
    fwd, bwd = (layer_kernels(_shape("metp", p), phase) for phase in ("fwd", "bwd"))
    assert _elements(fwd + bwd, "metp_p2p_mlp") == pytest.approx(24 * (p - 1) / p * H2)
    attention = ("metp_bcast_attn", "metp_p2p_kv", "metp_reduce_attn")
    ring = (p - 1) / p * BSH
    assert sum(_elements(fwd, a) for a in attention) == pytest.approx(
        4 * math.log2(p) * H2 + 2 * ring
    )
    assert sum(_elements(bwd, a) for a in attention) == pytest.approx(
        8 * math.log2(p) * H2 + 4 * ring
    )


def test_full_recompute_reruns_the_forward_chain_first():
    shape = _shape("metp", 4, "full")
    fwd, bwd = layer_kernels(shape, "fwd"), layer_kernels(shape, "bwd")
    assert [k.name for k in bwd[: len(fwd)]] == ["recompute_" + k.name for k in fwd]


def test_metp_overlap_threshold_is_the_papers_a100_figure():
    """Liang et al. §3.3: 312 TFLOPS over NVLink's 300 GB/s, 16-bit shards: m/p > 1040 rows (and
    8320 tokens on 8 GPUs at batch 1); 32-bit shards halve the intensity, so double the rows."""
    assert overlap_rows_threshold(312e12, 300e9, 2) == pytest.approx(1040)
    assert 8 * overlap_rows_threshold(312e12, 300e9, 2) == pytest.approx(8320)
    assert overlap_rows_threshold(312e12, 300e9, 4) == pytest.approx(2080)
    assert ring_exposed_share(1040, 1040) == 0 == ring_exposed_share(4096, 1040)
    assert ring_exposed_share(520, 1040) == pytest.approx(0.5)


@pytest.mark.parametrize("seq, hidden", [(512, False), (16384, True)])
def test_metp_ring_is_priced_exposed_only_below_the_threshold(seq, hidden):
    """The ring's P2P kernels cost nothing where the rank's rows (seq / p at batch 1) are above
    the threshold (here 50 TFLOPS over 100 GB/s, both at efficiency 0.7: 500 rows at 16 bits),
    and the share the GEMMs leave exposed below it; broadcasts and reduces are never hidden."""
    cluster = ClusterConfig(
        num_gpus=4, peak_tflops=50.0, intra_node_bandwidth_gbps=100.0, gpus_per_node=4
    )
    params = CostModelConfig(gemm_efficiency=0.7, network_efficiency=0.7)
    cost = CostModel(cluster, params)
    spec = replace(SPEC, seq_length=seq)
    shape = LayerShape(spec, 4, 1, True, 2, "none", tp_mode="metp")
    threshold = overlap_rows_threshold(50e12 * 0.7, 100e9 * 0.7, 2)
    assert threshold == pytest.approx(500)
    share = ring_exposed_share(seq / 4, threshold)
    assert (share == 0) == hidden
    for phase in ("fwd", "bwd"):
        works = layer_kernels(shape, phase)
        for work, kernel in zip(works, cost.layer(shape, phase, "vit", 100.0)):
            if not work.is_comm:
                continue
            wire = collective_bytes_on_wire(work.collective, work.bytes, work.group_size)
            unhidden = wire / (100e9 * 0.7) * 1e6
            if work.name.startswith("metp_p2p"):
                expected = share * unhidden + params.kernel_overhead_us if share else 0.0
            else:
                expected = unhidden + params.kernel_overhead_us
            assert kernel.duration_us == pytest.approx(expected), work.name
