"""tests/support/fuzz_inputs.py: a slice of the seeded input fuzzing runs in the suite; the full 500
cases run by hand.

The slice leaves out the checkpoint kind, which first trains a 1-rank job to make the checkpoint it
damages; test_checkpoint_faults.py damages checkpoints case by case instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.fuzz_inputs import FAILURES, KINDS, Case, Outcome, fuzz, main, table

WITHOUT_CHECKPOINT = tuple(kind for kind in KINDS if kind != "checkpoint")


def test_no_input_breaks_the_one_line_promise(tmp_path: Path) -> None:
    outcomes = fuzz(70, 11, limit=10.0, work=tmp_path, kinds=WITHOUT_CHECKPOINT)
    assert {o.case.kind for o in outcomes} == set(WITHOUT_CHECKPOINT)
    assert sum(o.result == "refused" for o in outcomes) > 35  # the cases do damage
    assert [o for o in outcomes if o.result in FAILURES] == []


def test_the_table_counts_failures_and_the_script_exits_1_on_them(monkeypatch, capsys) -> None:
    import support.fuzz_inputs as fuzz_inputs

    accepted = Outcome(
        Case("config value", 0, "training.lr = nan", True), "ACCEPTED", "went through", 0.1
    )
    refused = Outcome(
        Case("config value", 1, "training.lr = inf", True), "refused", "training.lr ...", 0.2
    )
    assert table([accepted, refused])[1].split() == [
        "config",
        "value",
        "2",
        "0",
        "1",
        "0",
        "0",
        "1",
        "0.20",
    ]
    monkeypatch.setattr(fuzz_inputs, "fuzz", lambda *args, **kwargs: [accepted, refused])
    assert main(["--cases", "2"]) == 1
    assert "ACCEPTED: config value #0: training.lr = nan: went through" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["--cases", "0"])
    assert exc.value.code == 2
    assert "--cases must be >= 1" in capsys.readouterr().err
