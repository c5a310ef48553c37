"""Every class of bad config gives one line naming the field and a fix, exit code 2, no
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from optimus_mllm.cli.plan import main

from support.paths import CONFIGS


def _set(raw: dict, dotted: str, value) -> dict:
    node = raw
    *parents, last = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return raw


def _delete(raw: dict, dotted: str) -> dict:
    node = raw
    *parents, last = dotted.split(".")
    for key in parents:
        node = node[key]
    del node[last]
    return raw


BAD = [
    # (mutation, expected substrings of the one error line)
    (
        lambda r: _set(r, "model.llm.hiden_size", 64),
        ["model.llm.hiden_size", "unknown key", "did you mean 'hidden_size'"],
    ),
    (
        lambda r: _set(r, "cluster.gpu_memroy_gib", 1),
        ["cluster.gpu_memroy_gib", "did you mean 'gpu_memory_gib'"],
    ),
    (
        lambda r: _set(r, "model.llm.num_layers", "four"),
        ["model.llm.num_layers", "expected an integer", "'four'"],
    ),
    (
        lambda r: _set(r, "training.sequence_parallel", "yes"),
        ["training.sequence_parallel", "expected true or false"],
    ),
    (
        lambda r: _set(r, "cluster.gpu_memory_gib", [1]),
        ["cluster.gpu_memory_gib", "expected a number"],
    ),
    (
        lambda r: _set(r, "training.precision", "fp8"),
        ["training.precision", "must be one of bf16, fp16, fp32"],
    ),
    (lambda r: _delete(r, "cluster.num_gpus"), ["cluster.num_gpus", "required"]),
    (
        lambda r: _set(r, "training.micro_batch_size", -2),
        ["training.micro_batch_size", "must be positive"],
    ),
    (
        lambda r: _set(r, "parallel.llm", {"dp": 1, "pp": 2, "tp": 3, "vp": 2}),
        ["parallel.llm", "dp*pp*tp = 1*2*3 = 6", "num_gpus=4"],
    ),
    (
        lambda r: _set(r, "parallel.llm", {"dp": 1, "pp": 4, "tp": 1, "vp": 2}),
        ["parallel.llm.pp", "pp*vp = 4*2", "num_layers=4", "use pp*vp in {1, 2, 4}"],
    ),
    (
        lambda r: _set(
            _set(r, "model.llm.num_attention_heads", 2), "parallel.llm", {"dp": 1, "pp": 1, "tp": 4}
        ),
        ["parallel.llm.tp", "num_attention_heads=2 is not divisible by tp=4", "use tp in {1, 2}"],
    ),
    (
        lambda r: _set(r, "model.llm.num_attention_heads", 3),
        ["model.llm.num_attention_heads", "3 does not divide hidden_size=64"],
    ),
    (
        lambda r: _set(r, "training.global_batch_size", 15),
        [
            "training.global_batch_size",
            "15 is not divisible by micro_batch_size=2",
            "multiple of 2",
        ],
    ),
    (
        lambda r: _set(
            _set(r, "training.global_batch_size", 6), "parallel.llm", {"dp": 4, "pp": 1, "tp": 1}
        ),
        ["training.global_batch_size", "micro_batch_size*dp = 2*4", "multiple of 8"],
    ),
    (
        lambda r: _set(r, "training.global_batch_size", 6),
        ["parallel.llm.vp", "3 microbatches per pipeline to be a multiple of pp=2"],
    ),
    (
        lambda r: _set(r, "parallel.encoder", {"pp": 4, "tp": 1}),
        ["parallel.encoder.pp", "4 does not divide the LLM's pp=2", "{1, 2}"],
    ),
    (
        lambda r: _set(r, "parallel.encoder", {"pp": 1, "tp": 4}),
        ["parallel.encoder.tp", "4 does not divide the LLM's tp=2"],
    ),
    (
        lambda r: _set(
            _set(
                _set(r, "training.sequence_parallel", True), "parallel.encoder", {"pp": 1, "tp": 2}
            ),
            "model.encoders",
            [dict(r["model"]["encoders"][0], seq_length=9)],
        ),
        [
            "parallel.encoder.tp",
            "model.encoders[0].seq_length=9 is not divisible by tp=2",
            "training.sequence_parallel",
        ],
    ),
    (
        lambda r: _set(
            r, "model.encoders", [dict(r["model"]["encoders"][0], projector={"spatial_merge": 3})]
        ),
        [
            "model.encoders[0].projector.spatial_merge",
            "3x3 = 9 patch tokens",
            "do not divide seq_length=16",
        ],
    ),
    (
        lambda r: _set(
            r, "model.encoders", [dict(r["model"]["encoders"][0], projector={"spatial_merge": 0})]
        ),
        ["model.encoders[0].projector.spatial_merge", "must be positive"],
    ),
    (
        lambda r: _set(
            _set(
                _set(r, "training.sequence_parallel", True), "parallel.encoder", {"pp": 1, "tp": 2}
            ),
            "model.encoders",
            [dict(r["model"]["encoders"][0], seq_length=36, projector={"spatial_merge": 2})],
        ),
        ["parallel.encoder.tp", "leaves 18 tokens per rank", "spatial_merge**2=4"],
    ),
    (
        lambda r: _set(_delete(r, "parallel.llm"), "parallel.encoder", {"pp": 1, "tp": 1}),
        ["parallel.encoder", "needs a fixed parallel.llm"],
    ),
    # TP modes (issues 36, 37): the degree each mode can take, one field named
    (
        lambda r: _set(r, "parallel.encoder", {"tp_mode": "4d"}),
        ["parallel.encoder.tp_mode", "must be one of 1d, 2d, 3d, metp", "'4d'"],
    ),
    (
        lambda r: _set(r, "parallel.encoder", {"pp": 1, "tp_mode": "metp"}),
        ["parallel.encoder.tp", "needs pp and tp together", "drop pp"],
    ),
    (
        lambda r: _set(r, "parallel.encoder", {"pp": 1, "tp": 1, "tp_mode": "metp"}),
        ["parallel.encoder.tp_mode", "metp needs a TP degree of at least 2", "use tp in {2}"],
    ),
    (
        lambda r: _set(r, "parallel.encoder", {"pp": 1, "tp": 2, "tp_mode": "2d"}),
        ["parallel.encoder.tp_mode", "square TP degree q*q", "got tp=2", "no tp fits"],
    ),
    (
        lambda r: _set(r, "parallel.llm", {"dp": 1, "pp": 2, "tp": 2, "tp_mode": "3d"}),
        ["parallel.llm.tp_mode", "model.llm: tp_mode=3d needs a cube TP degree p^3", "got tp=2"],
    ),
    (
        lambda r: _set(
            _set(r, "parallel.llm", {"dp": 1, "pp": 1, "tp": 4, "tp_mode": "2d"}),
            "model.llm.kv_channels",
            8,
        ),
        ["parallel.llm.tp_mode", "planned for plain layers", "use tp_mode 1d or metp"],
    ),
    (
        lambda r: _set(
            _set(
                _set(r, "parallel.llm", {"dp": 1, "pp": 1, "tp": 4}),
                "parallel.encoder",
                {"pp": 1, "tp": 4, "tp_mode": "metp"},
            ),
            "model.encoders",
            [dict(r["model"]["encoders"][0], class_token=True)],
        ),
        ["parallel.encoder.tp_mode", "model.encoders[0]: 17 tokens", "no tp fits tp_mode=metp"],
    ),
    (
        lambda r: _set(
            r, "model.encoders", [dict(r["model"]["encoders"][0], base="../nowhere.yaml")]
        ),
        ["model.encoders[0].base", "does not exist"],
    ),
    (lambda r: _set(r, "model.llm.seq_length", 16), ["model.llm.seq_length", "no room for text"]),
    (
        lambda r: _set(
            r, "model.encoders", [dict(r["model"]["encoders"][0], drop_class_token=True)]
        ),
        ["model.encoders[0].drop_class_token", "set class_token: true"],
    ),
    (
        lambda r: _set(
            r,
            "model.encoders",
            [dict(r["model"]["encoders"][0], class_token=True, projector={"spatial_merge": 2})],
        ),
        ["model.encoders[0].projector.spatial_merge", "merge the class token", "drop_class_token"],
    ),
    (
        lambda r: _set(
            _set(
                _set(r, "training.sequence_parallel", True), "parallel.encoder", {"pp": 1, "tp": 2}
            ),
            "model.encoders",
            [dict(r["model"]["encoders"][0], class_token=True)],
        ),
        [
            "parallel.encoder.tp",
            "seq_length=16 and the class token (17 tokens) is not divisible by tp=2",
        ],
    ),
    (
        lambda r: _set(
            r,
            "model.encoders",
            [dict(r["model"]["encoders"][0], projector={"type": "linear", "activation": "silu"})],
        ),
        ["model.encoders[0].projector.activation", "projector.type is linear"],
    ),
    (
        lambda r: _set(
            r,
            "model.encoders",
            [dict(r["model"]["encoders"][0], projector={"ffn_hidden_size": 0})],
        ),
        ["model.encoders[0].projector.ffn_hidden_size", "must be positive"],
    ),
    (
        lambda r: _set(
            r,
            "model.encoders",
            [dict(r["model"]["encoders"][0], projector={"activation": "tanh"})],
        ),
        [
            "model.encoders[0].projector.activation",
            "must be one of gelu, silu, relu, squared_relu, quick_gelu",
        ],
    ),
    (
        lambda r: (
            _set(r, "parallel.encoder", {"pp": 1, "tp": 2})
            and _set(
                r,
                "model.encoders",
                [dict(r["model"]["encoders"][0], projector={"ffn_hidden_size": 33})],
            )
        ),
        ["parallel.encoder.tp", "projector.ffn_hidden_size=33 is not divisible by tp=2"],
    ),
    (
        lambda r: _set(r, "cost_model.gemm_efficiency", 1.5),
        ["cost_model.gemm_efficiency", "(0, 1]"],
    ),
    (
        lambda r: _set(_set(r, "cluster.num_gpus", 12), "cluster.gpus_per_node", 8),
        ["cluster.num_gpus", "not a multiple of gpus_per_node=8"],
    ),
    (
        lambda r: _set(r, "training.optimizer", "lion"),
        ["training.optimizer", "must be one of adam, sgd"],
    ),
    (
        lambda r: _set(r, "training.lr_decay_style", "exp"),
        ["training.lr_decay_style", "must be one of constant, linear, cosine"],
    ),
    (lambda r: _set(r, "training.min_lr", 1.0), ["training.min_lr", "must be in [0, lr=0.0001]"]),
    (
        lambda r: _set(r, "training.lr_warmup_iters", 3),
        ["training.lr_warmup_iters", "must be below lr_decay_iters"],
    ),
    (lambda r: _set(r, "training.adam_beta2", 1.0), ["training.adam_beta2", "must be in [0, 1)"]),
    (lambda r: _set(r, "training.clip_grad", -1.0), ["training.clip_grad", "must be >= 0"]),
    (lambda r: _set(r, "training.loss_scale", 0), ["training.loss_scale", "must be positive"]),
]


@pytest.mark.parametrize("mutate, expected", BAD, ids=[e[0] for _, e in BAD])
def test_bad_config_one_line_exit_2(mutate, expected, tiny_raw, write_config, capsys):
    path = write_config(mutate(tiny_raw))
    assert main(["--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("optimus-plan: error: ")
    for fragment in expected:
        assert fragment in lines[0], (fragment, lines[0])


def test_invalid_yaml(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("cluster: {num_gpus: 4\nmodel: [")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not valid YAML at line" in err


def test_bad_override(capsys):
    assert (
        main(["--config", str(CONFIGS / "tiny.yaml"), "--override", "training.micro_batch_size"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--override" in err and "key=value" in err


def test_console_script_exit_code_and_no_traceback(tiny_raw, write_config, tmp_path):
    """The installed entry point, as a user runs it: exit 2, one line, and no JSON left behind."""
    path = write_config(_set(tiny_raw, "model.llm.num_layers", "four"))
    out_json = tmp_path / "plan.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "optimus_mllm.cli.plan",
            "--config",
            str(path),
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert not out_json.exists()
    assert list(tmp_path.glob(".plan.json*")) == []


def test_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_exponent_numbers_read_as_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads ``lr: 1e-4`` as a string; the config takes it as the number a user
    means."""
    from optimus_mllm.config import load_config

    text = (
        (CONFIGS / "tiny.yaml")
        .read_text()
        .replace("  train_iters: 3\n", "  train_iters: 3\n  lr: 1e-4\n  min_lr: 2E-5\n")
    )
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    training = load_config(path).training
    assert (training.lr, training.min_lr) == (1e-4, 2e-5)


# -- inputs a fuzzer found: each one line, within seconds ------------------------------------------

OVERRIDES = [
    (["training.lr=["], "training.lr: the --override value '[' is not valid YAML"),
    (["model.llm.num_layers=" + "9" * 5000], "holds a number Python cannot read"),
    (["model.llm.num_layers=1" + "0" * 400], "a 401-digit integer is beyond any config value"),
    (["cluster.gpu_memory_gib=.inf"], "cluster.gpu_memory_gib: must be a finite number"),
    (["cluster.gpu_memory_gib=.nan"], "cluster.gpu_memory_gib: must be a finite number"),
    (["training.lr=.nan"], "training.lr: must be a finite number"),
    (["training.lr=.inf"], "training.lr: must be a finite number"),
    (
        ["cost_model.kernel_overhead_us=.nan"],
        "cost_model.kernel_overhead_us: must be a finite number",
    ),
    (["cluster.peak_tflops=.inf"], "cluster.peak_tflops: must be a finite number"),
    (["parallel.llm.vp=0"], "parallel.llm.vp: must be positive"),
    (
        ["model.llm.num_layers=4000000000000"],
        "model.llm.num_layers: 4000000000000 is above the 1024",
    ),
    (["training.global_batch_size=16000000"], "training.global_batch_size: microbatches"),
    (
        ["cluster.num_gpus=1000000000000", "parallel.llm=null"],
        "cluster.num_gpus: 1000000000000 is above",
    ),
    (["training.global_batch_size=2048"], "2048 makes 1024 microbatches per pipeline"),
    (["parallel.llm={dp: 1, dp: 2, pp: 2, tp: 2, vp: 2}"], "key 'dp' is given twice"),
]


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optimus_mllm.cli.plan", *args],
        capture_output=True,
        text=True,
        # an input that hangs the reader (a FIFO, a pathological parse) fails here; how fast an
        # error comes is not a unit test's business (benchmarks hold speed targets)
        timeout=30,
    )


def _assert_one_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("optimus-plan: error: ") and expected in lines[0]
    ), proc.stderr


@pytest.mark.parametrize("overrides, expected", OVERRIDES, ids=[o[0][:40] for o, _ in OVERRIDES])
def test_an_override_beyond_bounds_is_one_line(overrides, expected):
    _assert_one_line(
        _plan_cli("--config", str(CONFIGS / "tiny.yaml"), "--override", *overrides), expected
    )


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


FILES = {
    "not UTF-8": (
        lambda d: _write(d / "c.yaml", b"name: x\n\xff\xfe bad\n"),
        "is not UTF-8 text (byte 8)",
    ),
    "nested 5000 deep": (
        lambda d: _write(d / "c.yaml", b"a: " + b"[" * 5000 + b"]" * 5000),
        "nests deeper than 32",
    ),
    "/dev/zero": (lambda d: Path("/dev/zero"), "is a device, not a regular file"),
    # open() of a FIFO with no writer used to wait forever
    "a FIFO with no writer": (lambda d: _fifo(d / "c.yaml"), "is a FIFO, not a regular file"),
    "a directory": (lambda d: d, "cannot read"),
    "a second training block": (
        lambda d: _write(d / "c.yaml", (CONFIG_TEXT + "training:\n  train_iters: 5\n").encode()),
        "key 'training' is given twice (line",
    ),
}
CONFIG_TEXT = (CONFIGS / "tiny.yaml").read_text()


@pytest.mark.parametrize("case", FILES)
def test_a_config_file_that_is_not_a_config_is_one_line(case, tmp_path):
    make, expected = FILES[case]
    _assert_one_line(_plan_cli("--config", str(make(tmp_path))), expected)
