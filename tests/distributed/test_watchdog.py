"""After the ranks connected: an error one rank meets, or a rank killed, ends every rank within
seconds with exit code 2 and one line in all, printed by whichever rank could say what happened."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from PIL import Image

from support.train_utils import Watch, ranks

pytestmark = pytest.mark.distributed


def _ranks(world: int, *args: str, watch: Watch | None = None) -> list[tuple[int, str, str]]:
    """``world`` ranks of the training program to their end, forked from the fork server (a fresh
    interpreter per rank spent 5-7 s of CPU on imports); (exit code, stdout, stderr) per rank."""
    return [(d.returncode, d.stdout, d.stderr) for d in ranks(world, *args, watch=watch)]


def _one_line_in_all(results: list[tuple[int, str, str]], expected: str) -> None:
    """One rank printed one line with ``expected`` on stderr, and no rank anything else."""
    lines = [line for _, _, err in results for line in err.splitlines()]
    assert (
        len(lines) == 1 and lines[0].startswith("optimus-train: error:") and expected in lines[0]
    ), lines


@pytest.fixture
def dataset_with_a_broken_image(tmp_path) -> tuple[str, list[dict]]:
    """16 records; record 5's image is a PNG cut in half."""
    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    records = []
    for i in range(16):
        Image.new("RGB", (16, 16), (i * 10, 50, 100)).save(root / "images" / f"{i}.png")
        records.append({"image": f"images/{i}.png", "text": f"picture number {i}"})
    whole = (root / "images" / "5.png").read_bytes()
    (root / "images" / "5.png").write_bytes(whole[: len(whole) // 2])
    return str(root), records


def test_an_image_only_one_rank_reads_ends_every_rank_with_its_line(dataset_with_a_broken_image):
    """The Optimus runtime spreads the microbatches over 4 encoder replicas: one rank decodes the
    broken
    image, says so, and the others, blocked in the schedule, exit without a word."""
    root, records = dataset_with_a_broken_image
    with open(os.path.join(root, "captions.jsonl"), "w") as out:
        out.writelines(json.dumps(record) + "\n" for record in records)
    started = time.monotonic()
    results = _ranks(4, "--override", f"data.path={root}", "training.global_batch_size=16")
    assert [code for code, _, _ in results] == [2] * 4, [err[-2000:] for _, _, err in results]
    _one_line_in_all(results, "captions.jsonl line 6: cannot read")
    assert time.monotonic() - started < 90


def test_a_decompression_bomb_is_one_line(tmp_path):
    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    # 1 bit per pixel: a small file
    Image.new("1", (20000, 20000)).save(root / "images" / "big.png")
    (root / "captions.jsonl").write_text(
        json.dumps({"image": "images/big.png", "text": "too big"}) + "\n"
    )
    results = _ranks(4, "--override", f"data.path={root}")
    assert [code for code, _, _ in results] == [2] * 4
    _one_line_in_all(results, "Pillow's decompression-bomb limit")


def test_a_rank_killed_mid_training_is_named_by_one_line():
    killed: list[float] = []

    def kill_rank_2_after_step_2(pids: list[int], outputs: list[Path]) -> None:
        # rank 0 prints the step lines, flushed as each step ends (into a file it opens once
        # forked)
        printed = outputs[0].read_text(errors="replace") if outputs[0].is_file() else ""
        if not killed and "\nstep 2/" in "\n" + printed:
            killed.append(time.monotonic())
            os.kill(pids[2], signal.SIGKILL)

    results = _ranks(4, "--override", "training.train_iters=200", watch=kill_rank_2_after_step_2)
    assert killed and time.monotonic() - killed[0] < 30
    assert [code for code, _, _ in results] == [2, 2, -signal.SIGKILL, 2], [
        err[-2000:] for _, _, err in results
    ]
    _one_line_in_all(results, "rank 2 stopped without a word")
