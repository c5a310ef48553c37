"""benchmarks/bench_gpu.py's training modes on the CPU: each mode in a process of its own, and the
profiled step ``scripts/gpu_truth.sh`` reads. The processes fork from the test session's fork
server (``support.train_utils.ranks``), so this file is marked distributed."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optimus_mllm.config import load_config

from support.paths import CONFIGS, REPO, load_script

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "benchmarks" / "bench_gpu.py"


def _tiny_on_one_rank(tmp_path: Path) -> Path:
    raw = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    raw["cluster"]["num_gpus"] = 1
    raw["training"]["global_batch_size"] = 8
    raw["parallel"]["llm"] = {"dp": 1, "pp": 1, "tp": 1, "vp": 1}
    path = tmp_path / "tiny_one_rank.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _forked(command: list[str], check: bool = False) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` (``command``) as a process forked from the test session's fork
    server, run as ``__main__`` (an interpreter of its own would import torch and megatron-core
    again); its output as ``subprocess.run(..., capture_output=True, text=True)`` gives it."""
    from support.train_utils import ranks

    executable, script, *args = command
    assert executable == sys.executable and check is False
    [done] = ranks(1, *args, program=(script,))
    return done


def test_each_training_mode_runs_in_a_process_of_its_own(tmp_path, monkeypatch):
    """A closed trainer keeps tensors alive (issue 40): on a GPU the baseline's memory would still
    be held while the Optimus trainer is built. Here on the CPU, with a tiny config; each mode's
    process forked from the fork server, running the command the bench builds."""
    module = load_script("bench_gpu")
    monkeypatch.setattr(module.subprocess, "run", _forked)
    config = load_config(_tiny_on_one_rank(tmp_path))
    result = module.measure_training(config, peak_tflops=1.0, steps=1, warmup=1)
    processes = [result[mode]["process"] for mode in module.MODES]
    assert len(set(processes)) == 2 and os.getpid() not in processes
    assert len(result["optimus"]["losses"]) == 2
    assert result["optimus"]["losses"] == pytest.approx(result["baseline"]["losses"], rel=1e-4)


def test_train_mode_prints_a_profiled_step(tmp_path):
    """What scripts/gpu_truth.sh's profile-train step reads: where a mode's step time goes."""
    out = tmp_path / "optimus.json"
    trace = tmp_path / "optimus.trace.json.gz"
    proc = _forked(
        [
            *(sys.executable, str(SCRIPT), "--config", str(_tiny_on_one_rank(tmp_path))),
            *("--train-mode", "optimus", "--steps", "1", "--warmup", "1"),
            *("--json", str(out), "--profile-rows", "5", "--trace", str(trace)),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert "optimus: one training step under torch.profiler" in proc.stdout
    assert "Self CPU" in proc.stdout
    assert len(json.loads(out.read_text())["losses"]) == 2  # the profiled step is not counted
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(event.get("name") == "aten::mm" for event in events)  # the step's own ops
