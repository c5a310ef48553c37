"""Write a tiny image-text dataset in the ``data.path`` format: coloured shapes and their captions.

    python scripts/make_sample_dataset.py --out DIR [--num-samples 64] [--size 32] [--seed 0]

DIR gets ``captions.jsonl`` and ``images/000000.png`` ...; each image is a square, a circle or
stripes on a background of another colour, captioned e.g. "a red circle on a blue background". The
same seed gives the same files. The dataset is written to a temporary folder beside DIR and renamed
at the end, so an interrupted run leaves no half-written DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
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
        "--num-samples", type=_positive_int, default=64, help="images to draw (default 64)"
    )
    parser.add_argument(
        "--size", type=_positive_int, default=32, help="image side in pixels (default 32)"
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


def write_dataset(folder: Path, num_samples: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    (folder / "images").mkdir()
    lines = []
    for i in range(num_samples):
        image, caption = draw_sample(rng, size)
        name = f"images/{i:06d}.png"
        image.save(folder / name)
        lines.append(json.dumps({"image": name, "text": caption}) + "\n")
    (folder / "captions.jsonl").write_text("".join(lines))


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
            write_dataset(tmp, args.num_samples, args.size, args.seed)
            tmp.replace(out)  # also replaces an empty DIR
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"wrote {args.num_samples} samples to {out}")
        return 0

    return run(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
