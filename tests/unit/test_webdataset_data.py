"""Multimodal webdataset shards (make_sample_dataset.py's default format), read by
Megatron-Energon."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from megatron.energon.epathlib import EPath
from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta
from PIL import Image

from support.paths import REPO

SCRIPT = REPO / "scripts" / "make_sample_dataset.py"
NUM_SAMPLES = 40


def make_webdataset(out: Path, *extra: str) -> Path:
    """The issue's command; in a process of its own, as energon's preparator starts workers."""
    args = ["--out", str(out), "--images-per-sample", "0-4", "--sizes", "16,32"]
    args += ["--text-only", "0.2", "--num-samples", str(NUM_SAMPLES), *extra]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == f"wrote {NUM_SAMPLES} samples to {out}\n", (
        done.stderr
    )
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_webdataset(tmp_path_factory.mktemp("wds") / "sample")


def _energon_samples(root: Path) -> list[dict]:
    meta = WebdatasetMeta.from_config(EPath(root.resolve()), split_part="train")
    reader = ShardInfosITarReader(EPath(root.resolve()), meta.shards)
    return [reader[i] for i in range(len(reader))]


def test_energon_reads_every_sample_with_its_images(shards):
    assert (shards / ".nv-meta" / "dataset.yaml").read_text().splitlines() == [
        "__module__: megatron.energon",
        "__class__: CrudeWebdataset",
    ]
    samples = _energon_samples(shards)
    assert [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(NUM_SAMPLES)]
    counts, sizes = [], set()
    for sample in samples:
        text = json.loads(sample["json"])["text"]
        images = [sample[f"{i}.png"] for i in range(text.count("<image>"))]
        assert sorted(k for k in sample if not k.startswith("__")) == sorted(
            ["json", *(f"{i}.png" for i in range(len(images)))]
        )
        for data in images:
            with Image.open(io.BytesIO(data)) as image:
                assert image.size[0] == image.size[1]
                sizes.add(image.size[0])
        counts.append(len(images))
    assert sizes == {16, 32}
    assert set(counts) == {0, 1, 2, 3, 4}
    assert 3 <= counts.count(0) <= 16  # about 20 % text-only, plus the 0 of 0-4


def test_same_seed_same_shards(shards, tmp_path):
    again = make_webdataset(tmp_path / "again")
    other = make_webdataset(tmp_path / "other", "--seed", "1")
    tars = sorted(p.name for p in shards.glob("*.tar"))
    assert tars == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert all((shards / t).read_bytes() == (again / t).read_bytes() for t in tars)
    assert (shards / tars[0]).read_bytes() != (other / tars[0]).read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
