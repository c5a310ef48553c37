"""The on-disk image-text dataset (data.path): layout, determinism, indexing, and one-line
errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from optimus_mllm.config import config_from_dict, load_config
from optimus_mllm.errors import ConfigError
from optimus_mllm.runtime.data import ImageTextDataset, synthetic_microbatch
from optimus_mllm.runtime.data_sources import check_dataset, microbatch_source

from support.paths import CONFIGS, REPO

SCRIPT = REPO / "scripts" / "make_sample_dataset.py"
# tiny.yaml: 2 samples per microbatch, 8 microbatches per iteration; 9 makes wrap-around visible
NUM_SAMPLES = 9
IMAGE_TOKENS, TEXT_START = 16, 16  # tiny.yaml: one encoder with 16 patch tokens, then text


def _script():
    spec = importlib.util.spec_from_file_location("make_sample_dataset", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "sample"
    assert (
        _script().main(
            ["--format", "captions", "--out", str(out), "--num-samples", str(NUM_SAMPLES)]
            + ["--size", "24"]
        )
        == 0
    )
    return out


def _captions(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "captions.jsonl").read_text().splitlines()]


def _tiny(path: Path, *overrides: str):
    return load_config(CONFIGS / "tiny.yaml", [f"data.path={path}", *overrides])


def _expected_patch(
    image_path: Path, mode: str, side: int, patch_size: int, row: int, col: int
) -> torch.Tensor:
    """One patch computed pixel by pixel, independently of the dataset's tensor reshaping."""
    image = Image.open(image_path).convert(mode).resize((side, side), Image.BICUBIC)
    values = []
    for y in range(row * patch_size, (row + 1) * patch_size):
        for x in range(col * patch_size, (col + 1) * patch_size):
            pixel = image.getpixel((x, y))
            values.extend(pixel if isinstance(pixel, tuple) else [pixel])
    return torch.tensor(values, dtype=torch.float32) / 127.5 - 1.0


# --------------------------------------------------------------------------------------------
# Microbatches


def test_microbatch_shapes_and_dtypes(sample):
    config = _tiny(sample)
    source = microbatch_source(config)
    assert isinstance(source, ImageTextDataset)
    mb = source(0, 0)
    (images,) = mb.images
    assert images.shape == (2, 16, 3 * 4 * 4) and images.dtype == torch.float32
    for tensor in (mb.tokens, mb.labels, mb.position_ids):
        assert tensor.shape == (2, 64) and tensor.dtype == torch.int64
    assert mb.loss_mask.shape == (2, 64) and mb.loss_mask.dtype == torch.float32
    assert torch.equal(mb.position_ids[1], torch.arange(64))
    assert sum(image.shape[1] for image in mb.images) == IMAGE_TOKENS


def test_deterministic_and_varied(sample):
    a, b = ImageTextDataset(_tiny(sample)), ImageTextDataset(_tiny(sample))
    first, again = a(2, 5), b(2, 5)
    for field in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(getattr(first, field), getattr(again, field)), field
    assert torch.equal(first.images[0], again.images[0])
    other = a(0, 1)
    assert not torch.equal(first.tokens, other.tokens)
    assert not torch.equal(first.images[0], other.images[0])


def test_tokens_labels_and_loss_mask_follow_the_caption(sample):
    captions = _captions(sample)
    mb = ImageTextDataset(_tiny(sample))(0, 1)  # records 2 and 3
    for j, record in enumerate((2, 3)):
        text = captions[record]["text"].encode()
        n = len(text)
        assert n < 48  # fits the 48 text positions, so there is padding to check
        tokens, labels, mask = mb.tokens[j], mb.labels[j], mb.loss_mask[j]
        assert bytes(tokens[TEXT_START : TEXT_START + n].tolist()) == text
        assert torch.equal(labels[:-1], tokens[1:])
        assert labels[TEXT_START + n - 2] == text[-1] and labels[TEXT_START + n - 1] == 0
        assert torch.all(tokens[TEXT_START + n :] == 0)
        assert torch.all(mask[:IMAGE_TOKENS] == 0), "no loss on image positions"
        assert torch.all(mask[TEXT_START : TEXT_START + n - 1] == 1)
        assert torch.all(mask[TEXT_START + n - 1 :] == 0), "no loss where the label is padding"


def test_long_caption_is_truncated(sample, tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    root = _dataset(
        tmp_path / "long", [json.dumps({"image": "a.png", "text": text})], sample, ["a.png"]
    )
    mb = ImageTextDataset(_tiny(root))(0, 0)
    assert bytes(mb.tokens[0, TEXT_START:].tolist()) == text[:48].encode()
    # the last position still predicts the next caption byte
    assert mb.labels[0, -1] == ord(text[48])
    assert torch.all(mb.loss_mask[0, TEXT_START:] == 1)


def test_record_index_cycles_through_the_file(sample):
    captions = _captions(sample)
    source = ImageTextDataset(_tiny(sample))
    # ((it * 8 + g) * 2 + j) % 9: (0, 4) wraps inside the microbatch, (1, 2) is 20 and 21, (3, 7) is
    # 62 and 63
    records = {(0, 0): (0, 1), (0, 4): (8, 0), (1, 2): (2, 3), (3, 7): (8, 0)}
    for (iteration, microbatch), expected in records.items():
        tokens = source(iteration, microbatch).tokens
        for row, record in zip(tokens, expected):
            text = captions[record]["text"].encode()
            assert bytes(row[TEXT_START : TEXT_START + len(text)].tolist()) == text, (
                iteration,
                microbatch,
            )
    assert torch.equal(source(0, 4).images[0], source(3, 7).images[0])


def test_image_values_and_patch_layout(sample):
    captions = _captions(sample)
    (images,) = ImageTextDataset(_tiny(sample))(0, 2).images  # records 4 and 5
    assert images.min() >= -1.0 and images.max() <= 1.0
    assert images.min() < 0 < images.max()
    expected = _expected_patch(sample / captions[5]["image"], "RGB", 16, 4, row=1, col=2)
    assert torch.allclose(images[1, 1 * 4 + 2], expected, atol=1e-6)


def test_each_encoder_gets_the_picture_at_its_own_resolution(sample, tiny_raw):
    gray = dict(
        tiny_raw["model"]["encoders"][0], name="gray", seq_length=4, patch_size=2, in_channels=1
    )
    tiny_raw["model"]["encoders"].append(gray)
    tiny_raw["data"] = {"path": str(sample)}
    config = config_from_dict(tiny_raw)
    check_dataset(config)
    rgb, grey = ImageTextDataset(config)(0, 0).images  # records 0 and 1
    assert rgb.shape == (2, 16, 48) and grey.shape == (2, 4, 4)
    image = sample / _captions(sample)[1]["image"]
    assert torch.allclose(grey[1, 3], _expected_patch(image, "L", 4, 2, row=1, col=1), atol=1e-6)
    assert torch.allclose(rgb[1, 0], _expected_patch(image, "RGB", 16, 4, row=0, col=0), atol=1e-6)


def test_config_without_data_is_synthetic():
    config = load_config(CONFIGS / "tiny.yaml")
    assert config.data.path is None
    check_dataset(config)  # nothing to check
    assert torch.equal(
        microbatch_source(config)(1, 3).tokens, synthetic_microbatch(config, 1, 3).tokens
    )


def test_relative_path_is_kept_and_read_from_the_working_directory(sample, monkeypatch):
    monkeypatch.chdir(sample.parent)
    config = _tiny(Path(sample.name))
    assert config.data.path == sample.name
    check_dataset(config)


def test_unknown_data_key():
    with pytest.raises(ConfigError, match=r"data\.paht: unknown key; did you mean 'path'"):
        load_config(CONFIGS / "tiny.yaml", ["data.paht=x"])


# --------------------------------------------------------------------------------------------
# check_dataset errors: one line naming the field and a fix


def _dataset(
    root: Path, lines: list[str], sample: Path, images: list[str], captions: bool = True
) -> Path:
    """A dataset with these raw captions.jsonl lines; each name in ``images`` is a copy of a sample
    PNG."""
    root.mkdir()
    if captions:
        (root / "captions.jsonl").write_text("".join(line + "\n" for line in lines))
    for name in images:
        shutil.copy(sample / "images" / "000000.png", root / name)
    return root


def _file(path: Path) -> Path:
    path.write_text("")
    return path


def _line(image: str = "a.png", text: str = "a red square") -> str:
    return json.dumps({"image": image, "text": text})


BROKEN = [
    # (name, make the dataset in a fresh root, config overrides, expected fragments of the one line)
    (
        "missing_dir",
        lambda root, s: root / "nowhere",
        (),
        ["data.path:", "does not exist", "make_sample_dataset.py"],
    ),
    ("not_a_dir", lambda root, s: _file(root), (), ["data.path:", "is not a folder"]),
    (
        "no_captions",
        lambda root, s: _dataset(root, [], s, [], captions=False),
        (),
        ["data.path:", "captions.jsonl does not exist"],
    ),
    (
        "bad_json",
        lambda root, s: _dataset(root, [_line(), "", '{"image": "a.png", "text": '], s, ["a.png"]),
        (),
        ["data.path: captions.jsonl line 3 is not valid JSON"],
    ),
    (
        "not_object",
        lambda root, s: _dataset(root, ['["a.png", "x"]'], s, []),
        (),
        ["data.path: captions.jsonl line 1 is not a JSON object"],
    ),
    (
        "missing_text",
        lambda root, s: _dataset(root, [_line(), '{"image": "a.png"}'], s, ["a.png"]),
        (),
        ['data.path: captions.jsonl line 2 has no string "text" field'],
    ),
    (
        "image_not_string",
        lambda root, s: _dataset(root, ['{"image": 3, "text": "abc"}'], s, []),
        (),
        ['data.path: captions.jsonl line 1 has no string "image" field'],
    ),
    (
        "short_text",
        lambda root, s: _dataset(root, [_line(text="x")], s, ["a.png"]),
        (),
        ["data.path: captions.jsonl line 1", "too short"],
    ),
    (
        "missing_image",
        lambda root, s: _dataset(root, [_line(), _line("b.png")], s, ["a.png"]),
        (),
        ["data.path: captions.jsonl line 2: image", "b.png does not exist"],
    ),
    (
        "empty_file",
        lambda root, s: _dataset(root, ["", "  "], s, []),
        (),
        ["data.path:", "has no records"],
    ),
    (
        "non_square",
        lambda root, s: _dataset(root, [_line()], s, ["a.png"]),
        ("model.encoders.0.seq_length=15",),
        ["model.encoders[0].seq_length: 15 is not a square number", "use e.g. 9 or 16"],
    ),
    (
        "in_channels",
        lambda root, s: _dataset(root, [_line()], s, ["a.png"]),
        ("model.encoders.0.in_channels=2",),
        ["model.encoders[0].in_channels: 2", "use 3 (RGB) or 1 (grayscale)"],
    ),
    (
        "small_vocab",
        lambda root, s: _dataset(root, [_line()], s, ["a.png"]),
        ("model.llm.vocab_size=255",),
        ["model.llm.vocab_size: 255 is too small", "at least 256"],
    ),
]


@pytest.mark.parametrize(
    "make, overrides, expected", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN]
)
def test_check_dataset_errors_are_one_line(make, overrides, expected, sample, tmp_path):
    config = _tiny(make(tmp_path / "d", sample), *overrides)
    with pytest.raises(ConfigError) as exc:
        check_dataset(config)
    message = str(exc.value)
    assert "\n" not in message
    for fragment in expected:
        assert fragment in message, (fragment, message)


def test_dataset_source_raises_the_same_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.path: .* does not exist"):
        microbatch_source(_tiny(tmp_path / "nowhere"))


def test_unreadable_image_names_its_line(sample, tmp_path):
    root = _dataset(tmp_path / "d", [_line(), _line("bad.png")], sample, ["a.png"])
    (root / "bad.png").write_text("not a picture")
    config = _tiny(root)
    check_dataset(config)  # existence only: images are not decoded up front
    with pytest.raises(
        ConfigError, match=r"data\.path: captions\.jsonl line 2: cannot read .*bad\.png"
    ):
        ImageTextDataset(config)(0, 0)


# --------------------------------------------------------------------------------------------
# The sample generator


def test_generator_is_deterministic_per_seed(tmp_path):
    script = _script()
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert (
            script.main(
                ["--format", "captions", "--out", str(tmp_path / name), "--num-samples", "3"]
                + ["--size", "8", "--seed", seed]
            )
            == 0
        )

    def files(name: str) -> dict[str, bytes]:
        root = tmp_path / name
        return {
            str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
        }

    assert files("a") == files("b")
    assert files("a") != files("c")
    assert len(files("a")) == 4
    assert [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".")
    ] == []  # no temporary folder left


def test_generator_refuses_a_non_empty_out(sample):
    before = sorted(p.name for p in sample.iterdir())
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(sample)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        f"make_sample_dataset.py: error: --out {sample} exists and is not empty; "
        "choose a new folder\n"
    )
    assert sorted(p.name for p in sample.iterdir()) == before
