"""Multimodal webdataset shards (make_sample_dataset.py's default format), read by
Megatron-Energon."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.energon.epathlib import EPath
from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta
from PIL import Image

from optimus_mllm.config import load_config
from optimus_mllm.errors import ConfigError
from optimus_mllm.runtime.data_sources import check_dataset, microbatch_source
from optimus_mllm.runtime.webdataset_data import WebdatasetSource

from support.paths import CONFIGS, REPO
from support.tokenizer import train_tokenizer

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


# --------------------------------------------------------------------------------------------
# Reading, tokenizing and packing (runtime.webdataset_data)


def _config(root: Path, *overrides: str):
    return load_config(CONFIGS / "tiny.yaml", [f"data.path={root}", *overrides])


@pytest.fixture(scope="module")
def tokenizer(shards, tmp_path_factory) -> Path:
    texts = [json.loads(s["json"])["text"] for s in _energon_samples(shards)]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "tokenizer")


PACKED = ("model.llm.seq_length=128", "data.samples_per_sequence=2")


def test_packed_microbatch_follows_its_samples(shards, tokenizer):
    """Row by row, independently of pack_row: each sample's tokens from the trained tokenizer with
    16 image positions per placeholder, end to end, its images in the encoder batch."""
    from tokenizers import Tokenizer

    config = _config(shards, f"data.tokenizer={tokenizer}", *PACKED)
    source = microbatch_source(config)
    assert isinstance(source, WebdatasetSource)
    hf = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    samples = _energon_samples(shards)
    seen_counts = set()
    for iteration, microbatch in ((0, 0), (0, 5), (2, 7)):
        mb = source(iteration, microbatch)
        rows = [((iteration * 8 + microbatch) * 2 + r) for r in range(2)]
        expected_images = []
        for r, row in enumerate(rows):
            tokens, segment, image_at = [], [], []
            for j in range(2):
                index = (row * 2 + j) % NUM_SAMPLES
                parts = json.loads(samples[index]["json"])["text"].split("<image>")
                for n, part in enumerate(parts):
                    if n:
                        image_at.append((len(tokens), index, n - 1))
                        tokens += [None] * 16
                        segment += [j] * 16
                    ids = hf.encode(part, add_special_tokens=False).ids
                    tokens += ids
                    segment += [j] * len(ids)
            fits = [a for a in image_at if a[0] + 16 <= 128]
            end = image_at[len(fits)][0] if len(fits) < len(image_at) else len(tokens)
            tokens, segment = tokens[: min(end, 129)], segment[: min(end, 129)]
            tokens += [0] * (129 - len(tokens))
            segment += [-1] * (129 - len(segment))
            inputs = [0 if t is None else t for t in tokens[:128]]
            assert mb.tokens[r].tolist() == inputs
            assert mb.labels[r].tolist() == [0 if t is None else t for t in tokens[1:]]
            assert mb.image_mask[r].tolist() == [t is None for t in tokens[:128]]
            loss = [
                float(tokens[p] is not None and tokens[p + 1] is not None and segment[p] >= 0)
                * float(segment[p] == segment[p + 1])
                for p in range(128)
            ]
            assert mb.loss_mask[r].tolist() == loss
            for p in range(128):  # causal inside a sample, nothing across samples
                visible = [q <= p and segment[q] == segment[p] for q in range(128)]
                assert (~mb.attention_mask[r, 0, p]).tolist() == visible
            starts = [p for p in range(128) if p == 0 or segment[p] != segment[p - 1]]
            assert mb.position_ids[r].tolist() == [
                p - max(s for s in starts if s <= p) for p in range(128)
            ]
            expected_images += [(index, k) for _, index, k in fits]
        assert mb.num_images == len(expected_images) == source.image_count(iteration, microbatch)
        seen_counts.add(mb.num_images)
        for n, (index, k) in enumerate(expected_images):
            with Image.open(io.BytesIO(samples[index][f"{k}.png"])) as image:
                resized = image.convert("RGB").resize((16, 16), Image.BICUBIC)
                pixel = torch.tensor(resized.getpixel((5, 1)), dtype=torch.float32) / 127.5 - 1
            # patch (row 0, column 1), its pixel (row 1, column 1), channel-last
            assert torch.allclose(mb.images[0][n, 1, (1 * 4 + 1) * 3 : (1 * 4 + 2) * 3], pixel)
    assert len(seen_counts) > 1


def test_same_microbatch_on_every_call_and_source(shards):
    a, b = microbatch_source(_config(shards)), microbatch_source(_config(shards))
    first, again = a(3, 4), b(3, 4)
    for field in ("tokens", "labels", "loss_mask", "position_ids", "image_mask"):
        assert torch.equal(getattr(first, field), getattr(again, field)), field
    assert torch.equal(first.images[0], again.images[0])
    # byte tokens without a tokenizer
    assert set(first.tokens[~first.image_mask].tolist()) <= set(range(256))


def test_a_text_only_microbatch_has_no_images(shards):
    source = microbatch_source(_config(shards, "training.micro_batch_size=1"))
    empty = [(it, g) for it in range(4) for g in range(16) if source.image_count(it, g) == 0]
    assert empty
    mb = source(*empty[0])
    assert mb.images[0].shape == (0, 16, 48) and not mb.image_mask.any()
    assert mb.loss_mask.sum() > 0


def _write_sample(root: Path, texts: list[str], images: list[int]) -> Path:
    """A prepared energon dataset of these samples (each with ``images[i]`` PNGs), in a process of
    its own (energon's preparator starts workers)."""
    root.mkdir()
    script = (
        "import io, json, sys, tarfile\n"
        "from PIL import Image\n"
        "from megatron.energon.epathlib import EPath\n"
        "from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator\n"
        "root, texts, images = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])\n"
        "with tarfile.open(root + '/s.tar', 'w') as tar:\n"
        "    for i, (text, n) in enumerate(zip(texts, images)):\n"
        "        files = [(f'{i:03d}.json', json.dumps({'text': text}).encode())]\n"
        "        for k in range(n):\n"
        "            png = io.BytesIO(); Image.new('RGB', (8, 8)).save(png, 'PNG')\n"
        "            files.append((f'{i:03d}.{k}.png', png.getvalue()))\n"
        "        for name, data in files:\n"
        "            info = tarfile.TarInfo(name); info.size = len(data)\n"
        "            tar.addfile(info, io.BytesIO(data))\n"
        "WebdatasetPreparator.prepare_dataset(EPath(root), ['s.tar'],\n"
        "    split_parts_ratio=[('train', 1.0)], workers=1)\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(root), json.dumps(texts), json.dumps(images)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return root


def test_a_sample_above_the_image_maximum_is_named(tmp_path):
    root = _write_sample(tmp_path / "d", ["one <image> x", "<image><image><image> y"], [1, 3])
    source = microbatch_source(_config(root, "data.max_images_per_sample=2"))
    with pytest.raises(
        ConfigError,
        match=r"^data\.max_images_per_sample: sample s\.tar/001 has 3 images, more than the 2 ",
    ):
        source(0, 0)


def test_adjacent_images_are_two_images(tmp_path):
    root = _write_sample(tmp_path / "d", ["<image><image> two", "none here"], [2, 0])
    mb = microbatch_source(_config(root, "training.micro_batch_size=1"))(0, 0)
    assert mb.num_images == 2 and mb.image_mask[0, :32].all() and not mb.image_mask[0, 32:].any()


def test_a_placeholder_without_its_image_is_named(tmp_path):
    root = _write_sample(tmp_path / "d", ["<image> and <image>"], [1])
    with pytest.raises(ConfigError, match=r"^data\.path: sample s\.tar/000 has 2 <image> .*000\.1"):
        microbatch_source(_config(root))(0, 0)


def test_data_errors_are_one_line(shards, tmp_path):
    (tmp_path / "empty" / ".nv-meta").mkdir(parents=True)
    (tmp_path / "empty" / ".nv-meta" / ".info.json").write_text('{"shard_counts": {}}')
    (tmp_path / "empty" / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train: []\nexclude: []\n"
    )
    (tmp_path / "tok").mkdir()
    cases = [
        (
            _config(tmp_path / "empty"),
            "data.path: ",
            "has no shards in its train split",
        ),
        (
            _config(shards, f"data.tokenizer={tmp_path / 'none'}"),
            "data.tokenizer: ",
            "does not exist; give a Hugging Face tokenizer folder holding tokenizer.json",
        ),
        (
            _config(shards, f"data.tokenizer={tmp_path / 'tok'}"),
            "data.tokenizer: cannot read",
            "tokenizer.json",
        ),
        (
            load_config(CONFIGS / "tiny.yaml", [f"data.tokenizer={tmp_path / 'tok'}"]),
            "data.tokenizer: tokenizes the text of an energon webdataset",
            "drop data.tokenizer",
        ),
        (
            _config(shards, "model.llm.vocab_size=200"),
            "model.llm.vocab_size: 200 is too small for the byte tokens",
            "use at least 256",
        ),
    ]
    for config, start, fragment in cases:
        with pytest.raises(ConfigError) as exc:
            check_dataset(config)
        message = str(exc.value)
        assert "\n" not in message and message.startswith(start) and fragment in message, message
    with pytest.raises(ConfigError, match=r"^data\.samples_per_sequence: must be positive"):
        _config(shards, "data.samples_per_sequence=0")


def test_images_are_spliced_at_their_positions_in_order(shards):
    """decoder_input_with_images: image n's tokens go to the n-th run of image positions, row by
    row; every other position keeps its word embedding."""
    from types import SimpleNamespace

    from optimus_mllm.runtime.llm import decoder_input_with_images

    mb = microbatch_source(_config(shards, *PACKED))(1, 3)
    seq, batch, hidden = 128, 2, 4
    words = torch.randn(seq, batch, hidden)
    chunk = SimpleNamespace(
        embedding=lambda input_ids, position_ids: words,
        config=SimpleNamespace(sequence_parallel=False),
    )
    images = torch.randn(16, mb.num_images, hidden)
    out = decoder_input_with_images(chunk, mb, images)
    n = 0
    for row in range(batch):
        p = 0
        while p < seq:
            if mb.image_mask[row, p]:
                assert torch.equal(out[p : p + 16, row], images[:, n]), (row, p)
                n, p = n + 1, p + 16
            else:
                assert torch.equal(out[p, row], words[p, row])
                p += 1
    assert n == mb.num_images > 1


def test_sdpa_attention_keeps_packed_samples_apart():
    """On a GPU the LLM's core attention is SdpaCoreAttention: with a packed mask each sample's
    output is that of the sample alone; causal_mask's tensor is plain causal attention."""
    from megatron.core.transformer import TransformerConfig

    from optimus_mllm.runtime.llm import SdpaCoreAttention, causal_mask, unfused_settings
    from optimus_mllm.runtime.webdataset_data import packed_attention_mask

    tconfig = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, **unfused_settings()
    )
    attention = SdpaCoreAttention(tconfig, 1, None, "self", attention_dropout=0.0).eval()
    seq, heads, dim = 10, 2, 4
    q, k, v = (torch.randn(seq, 1, heads, dim) for _ in range(3))
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, -1]])
    packed = attention(q, k, v, packed_attention_mask(segments))
    for lo, hi in ((0, 4), (4, 9), (9, 10)):
        alone = attention(q[lo:hi], k[lo:hi], v[lo:hi], causal_mask(hi - lo))
        assert torch.allclose(packed[lo:hi], alone, atol=1e-6), (lo, hi)
    causal = attention(q, k, v, causal_mask(seq))
    assert not torch.allclose(causal[4:9], packed[4:9], atol=1e-3)
