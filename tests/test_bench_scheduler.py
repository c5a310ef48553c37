"""The paper-scale benchmark runs and writes its figures (numbers are checked in the issue, not here)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_bench_scheduler_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_scheduler.py"), "--only", "strong_3072",
                           "model_a", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Table 7" in proc.stdout and "Table 5" in proc.stdout and "Sensitivity" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"strong_3072", "model_a", "strong_3072_1536tok"}
    for row in rows.values():
        assert row["optimus_s"] <= row["megatron_s"]
        assert all(-1e-9 <= row[k] <= 1 + 1e-9 for k in ("eff_coarse", "eff_fine"))
