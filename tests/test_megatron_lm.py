"""Megatron-LM's own ``pretrain_vlm.py``, unmodified, trained on gloo ranks through the CPU patches
for ``megatron.training`` (``megatron_patches.training_cpu``, ``optimus_mllm.megatron_lm_cpu``).

Needs a Megatron-LM checkout at tag ``core_v0.16.1`` named by ``MEGATRON_LM_DIR``; skipped without.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from megatron_lm_compare import (  # noqa: E402
    TINY_VLM_ARGS,
    Run,
    megatron_lm_dir,
    run_megatron_script,
)

CHECKOUT = megatron_lm_dir()
pytestmark = pytest.mark.skipif(
    CHECKOUT is None, reason="MEGATRON_LM_DIR (a Megatron-LM checkout at core_v0.16.1) is unset"
)


def _train(nproc: int, tp: int, pp: int) -> Run:
    assert CHECKOUT is not None
    parallel = ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp))
    run = run_megatron_script(CHECKOUT / "pretrain_vlm.py", nproc, [*TINY_VLM_ARGS, *parallel])
    assert run.returncode == 0, run.output[-4000:]
    assert [iteration.number for iteration in run.iterations] == [1, 2, 3], run.output[-4000:]
    return run


def test_pretrain_vlm_tp2_pp2_trains_as_tp1_pp2() -> None:
    # Megatron seeds each pipeline stage apart (seed + 100 * pp rank), so only runs with the same
    # PP draw the same weights; --use-cpu-initialization makes them independent of TP. Megatron
    # prints the loss to 7 digits and the grad norm to 3 decimals.
    tp2 = _train(4, tp=2, pp=2)
    tp1 = _train(2, tp=1, pp=2)
    for sharded, whole in zip(tp2.iterations, tp1.iterations):
        assert math.isfinite(sharded.lm_loss) and math.isfinite(sharded.grad_norm)
        assert sharded.lm_loss == pytest.approx(whole.lm_loss, rel=1e-5), (sharded, whole)
        assert sharded.grad_norm == pytest.approx(whole.grad_norm, abs=2e-3), (sharded, whole)
    # the model trains: three different losses, not one printed thrice
    assert len({iteration.lm_loss for iteration in tp2.iterations}) == 3


_RESTORE_CHECK = """
import sys
import megatron.core
sys.path.append(sys.argv[1])
import megatron.core.tensor_parallel as tensor_parallel
import megatron.training.initialize as initialize
import megatron.training.training as training
import megatron_patches
import megatron_patches.training_cpu as training_cpu

watched = [(training, "initialize_megatron"), (training, "get_model"), (training, "torch"),
           (initialize, "_warmup_jit_function"), (tensor_parallel, "broadcast_data")]
before = [getattr(owner, name) for owner, name in watched]
training_cpu.apply()
assert megatron_patches.is_applied()
assert all(getattr(o, n) is not b for (o, n), b in zip(watched, before))
training_cpu.remove()
assert not megatron_patches.is_applied() and not training_cpu.is_applied()
assert all(getattr(o, n) is b for (o, n), b in zip(watched, before))
print("restored")
"""


def test_training_patches_install_and_restore() -> None:
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", _RESTORE_CHECK, str(CHECKOUT)],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "restored" in result.stdout, result.stderr[-3000:]
