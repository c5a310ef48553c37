"""Write a tiny image-text dataset for ``data.path``: coloured shapes and their captions.

    python scripts/make_sample_dataset.py --out DIR [--images-per-sample 0-4] [--sizes 16,32]
        [--text-only 0.2] [--num-samples 64] [--samples-per-shard 16] [--seed 0]
    python scripts/make_sample_dataset.py --format captions --out DIR [--num-samples 64]
        [--size 32] [--seed 0]

Each image is a square, a circle or stripes on a background of another colour, captioned e.g. "a
red circle on a blue background".

``--format webdataset`` (the default): Megatron-Energon's layout, read by
``runtime.webdataset_data``. ``DIR/shard-000000.tar`` ... hold the samples, each a ``KEY.json``
``{"text": ...}`` whose text has ``<image>`` where each image goes and its images ``KEY.0.png``,
``KEY.1.png`` ... in that order, each at one of ``--sizes`` pixels square; a ``--text-only`` share
of the samples has no image. ``DIR/.nv-meta`` is what ``energon prepare`` writes (energon's own
preparator made it: the shard index, ``split.yaml`` with every shard in ``train``, and a
``dataset.yaml`` declaring a ``CrudeWebdataset``).

``--format captions``: ``captions.jsonl`` and ``images/000000.png`` ..., one image of ``--size``
pixels per sample (``runtime.data.ImageTextDataset``).

The same seed gives the same samples. The dataset is written to a temporary folder beside DIR and
renamed at the end, so an interrupted run leaves no half-written DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import sys
import tarfile
from pathlib import Path

from PIL import Image, ImageDraw

from optimus_mllm.cli.common import ArgumentParser, run
from optimus_mllm.errors import OptimusError

REPO = Path(__file__).resolve().parent.parent

PROG = "make_sample_dataset.py"
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 50, 170),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES = ("square", "circle", "stripes")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="Write a tiny sample dataset for data.path.")
    parser.add_argument("--out", required=True, type=Path, help="new (or empty) folder to write")
    parser.add_argument(
        "--format",
        choices=("webdataset", "captions"),
        default="webdataset",
        help="Megatron-Energon webdataset shards (default) or captions.jsonl with one image each",
    )
    parser.add_argument(
        "--num-samples", type=_positive_int, default=64, help="samples to draw (default 64)"
    )
    parser.add_argument(
        "--size", type=_positive_int, default=32, help="captions: image side in pixels (default 32)"
    )
    parser.add_argument(
        "--images-per-sample",
        type=_count_range,
        default=(0, 4),
        help="webdataset: LO-HI images in a sample with images, uniformly (default 0-4)",
    )
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=(16, 32),
        help="webdataset: image sides in pixels, one drawn per image (default 16,32)",
    )
    parser.add_argument(
        "--text-only",
        type=_share,
        default=0.2,
        help="webdataset: share of samples without images (default 0.2)",
    )
    parser.add_argument(
        "--samples-per-shard",
        type=_positive_int,
        default=16,
        help="webdataset: samples per .tar shard (default 16)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed; the same seed gives the same files"
    )
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _count_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI such as 0-4, got {text!r}") from None
    if not 0 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO <= HI, got {text!r}")
    return bounds


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(part) for part in text.split(","))


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1, got {value}")
    return value


def draw_sample(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    """One picture and its caption."""
    shape = rng.choice(SHAPES)
    colour, background = rng.sample(sorted(COLOURS), 2)
    image = Image.new("RGB", (size, size), COLOURS[background])
    draw = ImageDraw.Draw(image)
    if shape == "stripes":
        width = max(1, size // 8)
        for x in range(0, size, 2 * width):
            draw.rectangle((x, 0, x + width - 1, size - 1), fill=COLOURS[colour])
        return image, f"{colour} stripes on {_a(background)} background"
    side = rng.randint(max(1, size // 3), max(1, 2 * size // 3))
    left, top = rng.randint(0, size - side), rng.randint(0, size - side)
    box = (left, top, left + side - 1, top + side - 1)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    return image, f"{_a(colour)} {shape} on {_a(background)} background"


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def write_captions(folder: Path, num_samples: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    (folder / "images").mkdir()
    lines = []
    for i in range(num_samples):
        image, caption = draw_sample(rng, size)
        name = f"images/{i:06d}.png"
        image.save(folder / name)
        lines.append(json.dumps({"image": name, "text": caption}) + "\n")
    (folder / "captions.jsonl").write_text("".join(lines))


def write_webdataset(folder: Path, args: argparse.Namespace) -> None:
    """Shards of multi-image samples, then energon's metadata for them."""
    # imported here: the captions format needs no energon
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    rng = random.Random(args.seed)
    lo, hi = args.images_per_sample
    shards = []
    for first in range(0, args.num_samples, args.samples_per_shard):
        name = f"shard-{len(shards):06d}.tar"
        with tarfile.open(folder / name, "w", format=tarfile.USTAR_FORMAT) as tar:
            for index in range(first, min(first + args.samples_per_shard, args.num_samples)):
                text_only = rng.random() < args.text_only
                count = 0 if text_only else rng.randint(lo, hi)
                _add_sample(tar, f"{index:06d}", *draw_multimodal_sample(rng, count, args.sizes))
        shards.append(name)
    # energon's preparator reports on stdout; this script prints one line of its own
    with contextlib.redirect_stdout(io.StringIO()):
        WebdatasetPreparator.prepare_dataset(
            EPath(folder.resolve()),
            shards,
            split_parts_ratio=[("train", 1.0)],
            shuffle_seed=None,
            workers=1,
        )
    # what `energon prepare --sample-type CrudeWebdataset` writes: samples stay raw parts
    (folder / ".nv-meta" / "dataset.yaml").write_text(
        "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    )


IMAGE = "<image>"  # data.image_placeholder's default


def draw_multimodal_sample(
    rng: random.Random, count: int, sizes: tuple[int, ...]
) -> tuple[str, list[bytes]]:
    """A text with ``count`` image placeholders, each followed by its caption, and the PNGs; with no
    image, a sentence about two shapes."""
    if count == 0:
        first, second = (draw_sample(rng, 8)[1] for _ in range(2))
        return f"{first} beside {second}.", []
    parts, images = [], []
    for _ in range(count):
        image, caption = draw_sample(rng, rng.choice(sizes))
        encoded = io.BytesIO()
        image.save(encoded, format="PNG")
        images.append(encoded.getvalue())
        parts.append(f"{IMAGE} {caption}.")
    return " ".join(parts), images


def _add_sample(tar: tarfile.TarFile, key: str, text: str, images: list[bytes]) -> None:
    files = [(f"{key}.json", json.dumps({"text": text}).encode())]
    files += [(f"{key}.{i}.png", image) for i, image in enumerate(images)]
    for name, data in files:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644  # the same bytes for the same seed
        tar.addfile(info, io.BytesIO(data))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        out: Path = args.out
        if out.exists() and not (out.is_dir() and not any(out.iterdir())):
            raise OptimusError(f"--out {out} exists and is not empty; choose a new folder")
        out.parent.mkdir(parents=True, exist_ok=True)
        # beside DIR, so the rename stays on one disk
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        tmp.mkdir()
        try:
            if args.format == "captions":
                write_captions(tmp, args.num_samples, args.size, args.seed)
            else:
                write_webdataset(tmp, args)
            tmp.replace(out)  # also replaces an empty DIR
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"wrote {args.num_samples} samples to {out}")
        return 0

    return run(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
