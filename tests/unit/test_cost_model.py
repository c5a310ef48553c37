"""Cost model: kernel FLOPs against the closed forms, adjoint collectives, roofline and measured
profiles."""

from __future__ import annotations

import json

import pytest

from optimus_mllm.config import ClusterConfig, CostModelConfig, TransformerSpec
from optimus_mllm.costing.cost_model import (
    KERNEL_SET,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    SMS,
    TILE,
    CostModel,
    KernelWork,
    LayerShape,
    PieceShape,
    collective_bytes_on_wire,
    fit_comm,
    layer_kernels,
    load_comm_fits,
    load_profile,
    profile_device_problem,
    read_machine_profile,
    wave_factor,
)
from optimus_mllm.errors import OptimusError

GPT = TransformerSpec(
    num_layers=96, hidden_size=12288, num_attention_heads=96, ffn_hidden_size=49152, seq_length=2048
)


def _shape(tp=1, sp=True, recompute="none", b=2):
    return LayerShape(
        GPT, tp=tp, micro_batch_size=b, sequence_parallel=sp, dtype_bytes=2, recompute=recompute
    )


def _flops(kernels):
    return sum(k.flops for k in kernels if k.kind in ("gemm", "attention"))


def test_forward_flops_match_narayanan_formula():
    b, s, h = 2, GPT.seq_length, GPT.hidden_size
    assert _flops(layer_kernels(_shape(), "fwd")) == pytest.approx(
        24 * b * s * h * h * (1 + s / (6 * h))
    )


def test_tensor_parallel_divides_flops():
    full = _flops(layer_kernels(_shape(tp=1), "fwd"))
    assert _flops(layer_kernels(_shape(tp=8), "fwd")) == pytest.approx(full / 8)


def test_backward_is_twice_forward_and_adjoint_collectives():
    fwd, bwd = layer_kernels(_shape(tp=8), "fwd"), layer_kernels(_shape(tp=8), "bwd")
    assert _flops(bwd) == pytest.approx(2 * _flops(fwd))
    fwd_comm = [(k.name, k.collective) for k in fwd if k.is_comm]
    bwd_comm = [(k.name, k.collective) for k in bwd if k.is_comm]
    assert fwd_comm == [
        ("tp_ag_attn", "all_gather"),
        ("tp_rs_attn", "reduce_scatter"),
        ("tp_ag_mlp", "all_gather"),
        ("tp_rs_mlp", "reduce_scatter"),
    ]
    assert bwd_comm == [
        ("tp_ag_mlp", "all_gather"),
        ("tp_rs_mlp", "reduce_scatter"),
        ("tp_ag_attn", "all_gather"),
        ("tp_rs_attn", "reduce_scatter"),
    ]
    names = [k.name for k in bwd]
    assert len(names) == len(set(names)), "kernel names must be unique within a phase"


def test_no_sequence_parallel_uses_all_reduce_and_tp1_has_no_comm():
    comm = [k.collective for k in layer_kernels(_shape(tp=4, sp=False), "fwd") if k.is_comm]
    assert comm == ["all_reduce", "all_reduce"]
    assert not any(k.is_comm for k in layer_kernels(_shape(tp=1), "bwd"))


def test_recompute_adds_forward_work_to_backward():
    plain = _flops(layer_kernels(_shape(tp=8), "bwd"))
    fwd = _flops(layer_kernels(_shape(tp=8), "fwd"))
    attn = next(k.flops for k in layer_kernels(_shape(tp=8), "fwd") if k.name == "attn_core")
    assert _flops(layer_kernels(_shape(tp=8, recompute="selective"), "bwd")) == pytest.approx(
        plain + attn
    )
    assert _flops(layer_kernels(_shape(tp=8, recompute="full"), "bwd")) == pytest.approx(
        plain + fwd
    )


def test_ring_collective_volumes():
    assert collective_bytes_on_wire("all_gather", 800, 8) == 700
    assert collective_bytes_on_wire("reduce_scatter", 800, 8) == 700
    assert collective_bytes_on_wire("all_reduce", 800, 8) == 1400
    assert collective_bytes_on_wire("all_reduce", 800, 1) == 0


def test_roofline_durations():
    cluster = ClusterConfig(
        num_gpus=8, peak_tflops=1000, hbm_bandwidth_gbps=2000, intra_node_bandwidth_gbps=100
    )
    params = CostModelConfig(
        gemm_efficiency=0.5, memory_efficiency=1.0, network_efficiency=1.0, kernel_overhead_us=0
    )
    model = CostModel(cluster, params)
    gemm = KernelWork("fc1", "fwd", "gemm", flops=1e12, bytes=1.0)
    assert model.compute_us(gemm, "llm", 1) == pytest.approx(2000.0)  # 1e12 / (1e15 * 0.5) s
    norm = KernelWork("ln_attn", "fwd", "memory", flops=1.0, bytes=2e9)
    assert model.compute_us(norm, "llm", 1) == pytest.approx(1000.0)  # 2e9 / 2e12 s
    ag = KernelWork("tp_ag_attn", "fwd", "comm", bytes=8e8, collective="all_gather", group_size=8)
    assert model.comm_us(ag, 100.0) == pytest.approx(7000.0)  # 7e8 / 1e11 s


def _profile(tmp_path, entries, **header):
    data = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "kernel_set": KERNEL_SET,
        "kernels": entries,
        **header,
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


def test_measured_profile_overrides_roofline(tmp_path):
    path = _profile(
        tmp_path, [{"module": "llm", "kernel": "qkv", "phase": "fwd", "tp": 8, "time_us": 123.5}]
    )
    model = CostModel(ClusterConfig(num_gpus=8), CostModelConfig(), load_profile(path))
    kernels = {k.name: k for k in model.layer(_shape(tp=8), "fwd", "llm", 450.0)}
    assert kernels["qkv"].duration_us == 123.5
    roofline = {
        k.name: k
        for k in CostModel(ClusterConfig(num_gpus=8), CostModelConfig()).layer(
            _shape(tp=8), "fwd", "llm", 450.0
        )
    }
    assert kernels["fc1"].duration_us == roofline["fc1"].duration_us
    assert roofline["qkv"].duration_us != 123.5


def test_a_kernel_measured_at_one_size_is_priced_at_another_by_its_work(tmp_path):
    """A profile times each kernel at the config's shape (one image a sample); the same kernel on
    three images has three times the GEMM's FLOPs and the norm's bytes, so three times their
    time, not the one image's. At the shape measured a time is kept exactly, and an entry without
    its shape (an older profile) is not scaled."""
    from optimus_mllm.config import load_config

    from support.paths import CONFIGS

    gemm = KernelWork("qkv", "fwd", "gemm", flops=4e6, bytes=3e4)
    norm = KernelWork("ln_attn", "fwd", "memory", flops=1e3, bytes=2e4)
    shaped = [
        {"module": "vit", "kernel": w.name, "phase": "fwd", "tp": 1, "time_us": us}
        | {"flops": w.flops, "bytes": w.bytes}
        for w, us in ((gemm, 50.0), (norm, 8.0))
    ]
    bare = [{"module": "vit", "kernel": "fc1", "phase": "fwd", "tp": 1, "time_us": 70.0}]
    path = _profile(tmp_path, shaped + bare)
    config = load_config(CONFIGS / "tiny.yaml", [f"cost_model.profile={path}"])
    cost = CostModel.from_config(config)
    assert cost.compute_us(gemm, "vit", 1) == 50.0
    assert cost.compute_us(norm, "vit", 1) == 8.0
    three = {"flops": 3 * gemm.flops, "bytes": 3 * gemm.bytes}
    assert cost.compute_us(KernelWork("qkv", "fwd", "gemm", **three), "vit", 1) == 150.0
    assert cost.compute_us(KernelWork("ln_attn", "fwd", "memory", 3e3, 6e4), "vit", 1) == 24.0
    assert cost.compute_us(KernelWork("fc1", "fwd", "gemm", 9e9, 9e9), "vit", 1) == 70.0


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        (json.dumps({"format": "other"}), f"is not an {PROFILE_FORMAT} file"),
        (json.dumps({"format": PROFILE_FORMAT, "version": 99}), "version 99"),
        (
            json.dumps(
                {
                    "format": PROFILE_FORMAT,
                    "version": PROFILE_VERSION,
                    "kernel_set": KERNEL_SET,
                    "kernels": [{"module": "llm"}],
                }
            ),
            "kernels[0]",
        ),
        (
            json.dumps(
                {
                    "format": PROFILE_FORMAT,
                    "version": PROFILE_VERSION,
                    "kernel_set": "transformer_engine",
                    "kernels": [],
                }
            ),
            "timed the kernel set 'transformer_engine', but the runtime runs 'torch-sdpa'",
        ),
        (
            json.dumps({"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "kernels": []}),
            "timed the kernel set 'None'",
        ),
    ],
)
def test_bad_profile_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(OptimusError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_profile(path)


def test_backward_all_reduce_follows_the_gemm_whose_input_gradient_it_reduces():
    """Without sequence parallelism the forward all-reduce's adjoint is free; the all-reduce of the
    backward pass sums the partial input gradients of qkv / fc1, so it comes after them."""
    names = [k.name for k in layer_kernels(_shape(tp=4, sp=False), "bwd")]
    assert names == [
        "fc2",
        "act",
        "fc1",
        "tp_ar_mlp",
        "ln_mlp",
        "attn_proj",
        "attn_core",
        "qkv",
        "tp_ar_attn",
        "ln_attn",
    ]


def _gemm(out_tiles: int, blocks: int = 8, in_tiles: int = 4, fixed_bytes: float = 0.0):
    """A forward GEMM of ``blocks`` blocks of TILE rows, compute-bound (no HBM traffic of its
    own)."""
    shape = PieceShape(TILE * blocks, in_tiles, out_tiles, fixed_bytes)
    return KernelWork("fc1", "fwd", "gemm", 1e12, fixed_bytes, piece=shape)


def test_a_gemm_piece_pays_for_the_waves_its_tiles_fill():
    cost = CostModel(ClusterConfig(num_gpus=1), CostModelConfig(kernel_overhead_us=2.0))
    work, whole = _gemm(out_tiles=SMS // 2), 402.0  # 8 blocks of 66 tiles: 4 waves of 100 us
    piece = [cost.piece_us(work, whole, 0.0, k / 8) for k in range(1, 9)]
    # one block: half a wave's tiles, their inner dimension split over the idle SMs (split-K);
    # two: one full wave; three: a second wave for half of it
    assert piece[:4] == pytest.approx([52.0, 102.0, 202.0, 202.0])
    assert piece[7] == pytest.approx(whole)  # all blocks: the whole kernel
    # never cheaper than its share of the work plus a launch
    assert all(p >= k / 8 * (whole - 2.0) + 2.0 - 1e-9 for k, p in enumerate(piece, 1))
    # without an inner dimension to split (attention), one block takes a whole wave
    attention = KernelWork("attn_core", "fwd", "attention", 1e12, 0.0, piece=work.piece)
    assert cost.piece_us(attention, whole, 0.0, 1 / 8) == pytest.approx(102.0)


def test_a_whole_kernel_pays_for_the_waves_its_tiles_fill():
    cost = CostModel(
        ClusterConfig(num_gpus=1, peak_tflops=1000),
        CostModelConfig(gemm_efficiency=0.5, kernel_overhead_us=0.0),
    )
    full = _gemm(out_tiles=SMS // 2)  # 8 blocks of 66 tiles: 4 full waves
    assert wave_factor(full) == 1.0
    assert cost.compute_us(full, "vit", 1) == pytest.approx(2000.0)  # 1e12 / (1e15 * 0.5) s
    ragged = _gemm(out_tiles=SMS // 2, blocks=9)  # 4.5 waves' tiles take 5 waves
    assert wave_factor(ragged) == pytest.approx(5 / 4.5)
    assert cost.compute_us(ragged, "vit", 1) == pytest.approx(2000.0 * 5 / 4.5)
    # a GEMM of fewer tiles than SMs splits its inner dimension over the idle ones (split-K)
    assert wave_factor(_gemm(out_tiles=SMS // 4, blocks=1, in_tiles=2)) == pytest.approx(2.0)
    # a backward GEMM: its input gradient (9 x 4 tiles, split 3 ways over its 66 output tiles)
    # and its weight gradient (4 x 66 tiles: 2 waves for 2 waves' worth), half the FLOPs each;
    # a recomputed forward is priced as the forward
    bwd = KernelWork("fc1", "bwd", "gemm", 2e12, 0.0, piece=ragged.piece)
    assert wave_factor(bwd) == pytest.approx(0.5 * (SMS / (36 * 3)) + 0.5)
    redo = KernelWork("recompute_fc1", "bwd", "gemm", 1e12, 0.0, piece=ragged.piece)
    assert wave_factor(redo) == wave_factor(ragged)


def test_a_piece_streams_the_weights_again_and_a_backward_piece_recomputes_its_rows():
    cluster, params = ClusterConfig(num_gpus=1), CostModelConfig(kernel_overhead_us=2.0)
    cost = CostModel(cluster, params)
    hbm_us = 1 / (cluster.hbm_bandwidth_gbps * 1e3 * params.memory_efficiency)
    weights = 256 * 2**20  # 115 us of HBM traffic, more than the piece's 50 us of compute
    work = _gemm(out_tiles=SMS // 2, fixed_bytes=weights)
    assert cost.piece_us(work, 402.0, 0.0, 1 / 8) == pytest.approx(weights * hbm_us + 2.0)
    act = next(k for k in layer_kernels(_shape(tp=8), "bwd") if k.name == "act")
    whole = cost.compute_us(act, "llm", 8)
    plain = cost.piece_us(act, whole, 0.0, 0.25)
    assert plain == pytest.approx((whole - 2.0) / 4 + 2.0)  # memory-bound: its rows' share
    assert cost.piece_us(act, whole, 0.0, 0.25, recompute_us=40.0) == pytest.approx(plain + 10.0)


def test_piece_prices_list_every_piece_short_of_the_whole_kernel():
    cost = CostModel(ClusterConfig(num_gpus=1), CostModelConfig(kernel_overhead_us=2.0))
    prices = cost.piece_prices(_gemm(out_tiles=SMS // 2), 402.0)
    assert prices.blocks == 8 and prices.us[0] == 0.0
    assert prices.us[1:4] == pytest.approx((52.0, 102.0, 202.0))
    assert [prices.most_blocks(t) for t in (40.0, 52.0, 150.0, 202.0)] == [0, 1, 2, 4]
    assert cost.piece_prices(_gemm(out_tiles=4, blocks=1), 50.0) is None  # one block: no pieces


def test_a_communication_fit_recovers_its_line_and_keeps_latency_non_negative():
    sizes = [1e4, 1e5, 1e6, 4e6]
    fit = fit_comm("all_reduce", 2, sizes, [30.0 + 2e-4 * s for s in sizes])
    assert fit.latency_us == pytest.approx(30.0)
    assert fit.us_per_byte == pytest.approx(2e-4)
    # times that a line through them would start below zero: through the origin instead
    steep = fit_comm("p2p", 2, [1e4, 2e4], [1.0, 100.0])
    assert steep.latency_us == 0.0 and steep.us(2e4) > 0
    with pytest.raises(OptimusError, match="one size only"):
        fit_comm("p2p", 2, [1e4, 1e4], [1.0, 2.0])


def test_a_profiles_communication_fit_prices_its_collective_and_group_size_only(tmp_path):
    path = _profile(tmp_path, [])
    data = json.loads(path.read_text())
    data["communication"] = [
        {"collective": "all_reduce", "group_size": 2, "latency_us": 50.0, "us_per_byte": 1e-3}
    ]
    path.write_text(json.dumps(data))
    cluster = ClusterConfig(num_gpus=8, intra_node_bandwidth_gbps=100)
    model = CostModel(cluster, CostModelConfig(), load_profile(path), load_comm_fits(path))
    two = KernelWork("tp_ar_mlp", "fwd", "comm", bytes=1e6, collective="all_reduce", group_size=2)
    assert model.comm_us(two, 100.0) == pytest.approx(50.0 + 1e3)
    # another group size, another collective: the bandwidth model, as without a profile
    roofline = CostModel(cluster, CostModelConfig())
    for work in (
        KernelWork("tp_ar_mlp", "fwd", "comm", bytes=1e6, collective="all_reduce", group_size=4),
        KernelWork("tp_ag_attn", "fwd", "comm", bytes=1e6, collective="all_gather", group_size=2),
    ):
        assert model.comm_us(work, 100.0) == roofline.comm_us(work, 100.0)
    data["communication"][0]["latency_us"] = -1.0
    path.write_text(json.dumps(data))
    with pytest.raises(OptimusError, match=r"communication\[0\].*negative or non-finite"):
        load_comm_fits(path)


def test_a_profile_of_another_device_kind_is_refused_in_one_line(tmp_path):
    cpu = _profile(tmp_path, [], device_kind="cpu")
    assert profile_device_problem(str(cpu), "cpu") is None
    assert profile_device_problem(None, "cuda") is None
    assert profile_device_problem(str(cpu), "cuda") == (
        f"cost_model.profile: {cpu} was measured on a cpu device, this job runs on cuda; profile "
        "this machine with optimus-profile, or drop cost_model.profile"
    )
    # a profile from before the field came from optimus-profile on a GPU
    older = tmp_path / "older"
    older.mkdir()
    assert "measured on a cuda device" in profile_device_problem(str(_profile(older, [])), "cpu")
    # only a CPU profile makes the scheduler count a TP collective's wait as busy
    cluster, params = ClusterConfig(num_gpus=8), CostModelConfig()
    assert CostModel(cluster, params).encoder_runs_beside_the_llm
    assert not CostModel(cluster, params, device_kind="cpu").encoder_runs_beside_the_llm


def test_a_profiles_layer_host_work_is_added_to_its_layers_at_every_tp(tmp_path):
    fc1 = {"module": "llm", "kernel": "fc1", "tp": 1, "time_us": 10.0}
    path = _profile(
        tmp_path,
        [{**fc1, "phase": "fwd"}, {**fc1, "phase": "bwd"}],
        layer_host=[{"module": "llm", "phase": "fwd", "host_us": 800.0}],
    )
    machine = read_machine_profile(path)
    assert machine.layer_host_us == {("llm", "fwd"): 800.0}
    # the kernels keep the times they were measured at alone
    assert {k.key: k.time_us for k in machine.kernels} == load_profile(path)
    spec = TransformerSpec(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=16
    )
    for tp in (1, 2):
        shape = LayerShape(spec, tp, 1, False, 4)
        plain = CostModel(ClusterConfig(num_gpus=8), CostModelConfig())
        hosted = CostModel(
            ClusterConfig(num_gpus=8), CostModelConfig(), layer_host_us=machine.layer_host_us
        )
        for phase, added in (("fwd", 800.0), ("bwd", 0.0)):
            before, after = (
                plain.layer(shape, phase, "llm", 100.0),
                hosted.layer(shape, phase, "llm", 100.0),
            )
            # the layer's host work once per layer, over its compute kernels, whatever the TP;
            # its collectives cost what they did
            assert sum(k.duration_us for k in after) == pytest.approx(
                sum(k.duration_us for k in before) + added
            )
            assert [k.duration_us for k in after if k.is_comm] == [
                k.duration_us for k in before if k.is_comm
            ]
            assert plain.layer(shape, phase, "vit", 100.0) == hosted.layer(
                shape, phase, "vit", 100.0
            )
    for bad in (-1.0, float("nan"), "x"):
        data = json.loads(path.read_text())
        data["layer_host"][0]["host_us"] = bad
        path.write_text(json.dumps(data))
        with pytest.raises(OptimusError, match=r"layer_host\[0\]"):
            read_machine_profile(path)
    # a profile of the first CPU format scaled kernels by a factor: re-profiled, not misread
    data["layer_host"][0]["host_us"] = 1.0
    data["layer_scales"] = [{"module": "llm", "phase": "fwd", "scale": 1.5}]
    path.write_text(json.dumps(data))
    with pytest.raises(OptimusError, match=r"has layer_scales.*re-run optimus-profile$"):
        read_machine_profile(path)


def test_a_profiles_optimizer_step_is_priced_per_parameter(tmp_path):
    path = _profile(tmp_path, [], optimizer_us_per_param=0.01)
    machine = read_machine_profile(path)
    assert machine.optimizer_us_per_param == 0.01
    cost = CostModel(ClusterConfig(num_gpus=8), CostModelConfig(), optimizer_us_per_param=0.01)
    assert cost.optimizer_us(1e6) == pytest.approx(1e4)
    assert CostModel(ClusterConfig(num_gpus=8), CostModelConfig()).optimizer_us(1e6) == 0.0
    for bad in (-1.0, "fast"):
        data = json.loads(path.read_text())
        data["optimizer_us_per_param"] = bad
        path.write_text(json.dumps(data))
        with pytest.raises(OptimusError, match="optimizer_us_per_param"):
            read_machine_profile(path)
