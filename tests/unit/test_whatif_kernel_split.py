"""benchmarks/whatif_kernel_split.py: the split it models, and that it runs end to end."""

import json
import subprocess
import sys

import pytest

from optimus_mllm.scheduler.encoder_costs import EncoderKernel, StageChain

from support.paths import REPO, load_script

split_chain = load_script("whatif_kernel_split").split_chain


def test_split_chain_cuts_long_compute_kernels_into_equal_pieces_that_each_pay_the_launch():
    chain = StageChain(
        (
            EncoderKernel("vit", 0, "fc1", "fwd", False, 102.0, True),
            EncoderKernel("vit", 0, "tp_ag_mlp", "fwd", True, 300.0),
            EncoderKernel("vit", 0, "act", "fwd", False, 12.0, True),
        )
    )
    split = split_chain(chain, 40.0, 2.0)
    assert [k.name for k in split.kernels] == ["fc1.0", "fc1.1", "fc1.2", "tp_ag_mlp", "act"]
    assert not any(k.splittable for k in split.kernels)  # equal pieces, never cut further
    assert [k.duration_us for k in split.kernels[:3]] == pytest.approx(
        [(102.0 - 2.0) / 3 + 2.0] * 3
    )
    assert split.duration_us == pytest.approx(chain.duration_us + 2 * 2.0)  # two more launches
    assert split_chain(chain, 40.0, 0.0).duration_us == pytest.approx(chain.duration_us)


def test_whatif_kernel_split_prints_and_writes_each_piece_size(tmp_path):
    out = tmp_path / "whatif.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "whatif_kernel_split.py"),
            "--only",
            "fig5_heavy",
            "--pieces",
            "40",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    case = json.loads(out.read_text())["fig5_heavy"]
    rows = [(r["split"], r["piece_us"], r["pricing"]) for r in case["rows"]]
    assert rows == [
        ("whole", None, "launch"),
        ("equal", 40.0, "launch"),
        ("equal", 40.0, "free"),
        ("fit", None, "shape"),
        ("fit", None, "launch"),
        ("fit", None, "free"),
    ]
    assert case["llm_plan"] == "DP1 PP4 TP2 V10" and case["balanced_s"] < case["megatron_s"]
    assert "pieces <= 40 us free" in proc.stdout and "pieces fit to bubbles by shape" in proc.stdout
    whole, shaped, fit, fit_free = (case["rows"][i] for i in (0, 3, 4, 5))
    # whole kernels fit no TP bubble
    assert whole["optimus_s"] == whole["coarse_s"] > case["balanced_s"]
    # cut to the bubbles with each piece at its share of the work plus a launch, Optimus gains on
    # whole kernels; priced by their shape, no GEMM piece fits this case's 20-30 us TP bubbles
    # (each streams its GEMM's weights again), so cutting buys little or nothing here
    assert fit_free["optimus_s"] <= fit["optimus_s"] < shaped["optimus_s"] <= whole["optimus_s"]
    assert case["balanced_s"] < whole["optimus_s"]
    for args in (
        ["--pieces", "0"],
        ["--pieces", "-5"],
        ["--pieces", "nan"],
        ["--pieces", "inf"],
        ["--json", str(tmp_path / "missing" / "out.json")],
    ):
        bad = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "whatif_kernel_split.py"), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and args[0] in bad.stderr, (
            args,
            bad.stderr,
        )
    assert not (tmp_path / "missing").exists()
