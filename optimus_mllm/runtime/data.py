"""Image-text microbatches, the same on every rank and under every parallel plan.

A sample is one image per encoder, given as flattened patches ``[seq_length, in_channels *
patch_size**2]``, and ``llm.seq_length`` tokens whose first ``sum(encoder seq_length)`` positions
are image tokens (replaced by the projected encoder output) and the rest text. The loss covers the
text positions' next-token predictions. A source is a pure function of (iteration, global
microbatch), so a microbatch does not depend on which rank or plan produces it, and a resumed job
sees the same data.

Three sources: ``synthetic_microbatch`` draws every tensor from a generator seeded by (seed,
iteration, global microbatch); ``ImageTextDataset`` reads a folder of images with JSONL captions
(``data.path``); ``webdataset_data.WebdatasetSource`` reads Megatron-Energon shards of samples with
0..n images each, packed into sequences, so that a microbatch's images (the encoders' batch) vary.
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from optimus_mllm.config import OptimusConfig
from optimus_mllm.config.files import read_regular_file
from optimus_mllm.errors import ConfigError


@dataclass(frozen=True)
class Microbatch:
    images: tuple[torch.Tensor, ...]  # per encoder: [micro_batch, seq_length, patch_dim]
    tokens: torch.Tensor  # [micro_batch, llm_seq]
    labels: torch.Tensor  # [micro_batch, llm_seq]: the next token
    loss_mask: torch.Tensor  # [micro_batch, llm_seq]: 1 on text positions whose label is text
    position_ids: torch.Tensor  # [micro_batch, llm_seq]
    # [micro_batch, llm_seq], True where an image's tokens go, the images in row-major order (the
    # batch dimension of ``images``); None: each sample's first ``image_tokens`` positions hold its
    # one image
    image_mask: torch.Tensor | None = None
    # [micro_batch, 1, llm_seq, llm_seq], True = masked (packed samples do not see each other);
    # None: causal
    attention_mask: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        """The encoders' batch: one image per sample, or a packed microbatch's images."""
        return self.images[0].shape[0] if self.images else 0


def synthetic_microbatch(
    config: OptimusConfig, iteration: int, global_microbatch: int
) -> Microbatch:
    """Microbatch ``global_microbatch`` (counted over all data-parallel replicas) of
    ``iteration``."""
    t, llm = config.training, config.llm
    generator = torch.Generator().manual_seed(
        zlib.crc32(f"{t.seed}:{iteration}:{global_microbatch}".encode())
    )
    images = tuple(
        torch.randn(
            t.micro_batch_size, e.seq_length, e.in_channels * e.patch_size**2, generator=generator
        )
        for e in config.encoders
    )
    sequence = torch.randint(
        0, llm.vocab_size, (t.micro_batch_size, llm.seq_length + 1), generator=generator
    )
    loss_mask = torch.ones(t.micro_batch_size, llm.seq_length)
    loss_mask[:, : config.image_tokens] = 0.0
    positions = torch.arange(llm.seq_length).unsqueeze(0).expand(t.micro_batch_size, -1)
    return Microbatch(
        images,
        sequence[:, :-1].contiguous(),
        sequence[:, 1:].contiguous(),
        loss_mask,
        positions.contiguous(),
    )


MicrobatchSource = Callable[[int, int], Microbatch]  # (iteration, global microbatch) -> Microbatch
ImageCount = Callable[[int, int], int]  # (iteration, global microbatch) -> its number of images
# (iteration, global microbatch) -> patches per encoder
ImageSource = Callable[[int, int], tuple[torch.Tensor, ...]]


# --------------------------------------------------------------------------------------------
# On-disk image-text data


CAPTIONS = "captions.jsonl"
BYTE_VOCAB = 256  # text tokens are UTF-8 bytes
PAD = 0  # token after the caption; never a label the loss sees
_IMAGE_MODES = {3: "RGB", 1: "L"}  # encoder in_channels -> Pillow mode


def image_mode(in_channels: int) -> str:
    """The Pillow mode an encoder with ``in_channels`` takes its images in."""
    return _IMAGE_MODES[in_channels]


# decoded samples kept: the encoder and LLM stages on one rank ask for the same ones
_CACHED_IMAGES = 128
_SAMPLE_HINT = "python scripts/make_sample_dataset.py --out DIR makes a sample"


@dataclass(frozen=True)
class Caption:
    line: int  # in captions.jsonl, for error messages
    image: Path
    text: bytes  # UTF-8


class ImageTextDataset:
    """A folder of images with captions, as a ``MicrobatchSource``.

    ``DIR/captions.jsonl`` holds one JSON object per line, ``{"image": "images/000000.png", "text":
    "a red square on a blue background"}``, with image paths relative to DIR and any format Pillow
    reads. Each encoder gets the same picture, converted to its ``in_channels`` (3: RGB, 1:
    grayscale), resized (bicubic) to a square of ``sqrt(seq_length) * patch_size`` pixels, scaled to
    [-1, 1] and cut into patches. The caption's UTF-8 bytes (token ids 0-255) follow the image
    tokens; a longer caption is cut, a shorter one padded with token 0 that the loss skips.

    Sample j of global microbatch g in iteration it is record ``((it * num_microbatches_total + g) *
    micro_batch_size + j) % len(records)``: epochs cycle through the file in order. captions.jsonl
    is read once here; images are decoded when first asked for and a few are cached.
    """

    def __init__(self, config: OptimusConfig) -> None:
        if config.data.path is None:
            raise ValueError("ImageTextDataset needs config.data.path")
        _check_model(config)
        self.config = config
        self.captions = read_captions(Path(config.data.path))
        self._sample_images = functools.lru_cache(maxsize=_CACHED_IMAGES)(self._decode)

    def __call__(self, iteration: int, global_microbatch: int) -> Microbatch:
        t, llm = self.config.training, self.config.llm
        first = (
            iteration * self.config.num_microbatches_total + global_microbatch
        ) * t.micro_batch_size
        indices = [(first + j) % len(self.captions) for j in range(t.micro_batch_size)]
        images = tuple(
            torch.stack(per_encoder) for per_encoder in zip(*map(self._sample_images, indices))
        )
        texts = [
            text_sequence(self.captions[i].text, self.config.image_tokens, llm.seq_length)
            for i in indices
        ]
        sequence, loss_mask = (torch.stack(parts) for parts in zip(*texts))
        positions = torch.arange(llm.seq_length).unsqueeze(0).expand(t.micro_batch_size, -1)
        return Microbatch(
            images,
            sequence[:, :-1].contiguous(),
            sequence[:, 1:].contiguous(),
            loss_mask,
            positions.contiguous(),
        )

    def _decode(self, index: int) -> tuple[torch.Tensor, ...]:
        caption = self.captions[index]
        try:
            with Image.open(caption.image) as image:
                return encoder_patches(self.config, image)
        except Image.DecompressionBombError:
            raise ConfigError(
                "data.path",
                f"{CAPTIONS} line {caption.line}: {caption.image} has more than "
                f"{2 * Image.MAX_IMAGE_PIXELS} pixels (Pillow's decompression-bomb limit); resize "
                "it "
                "or drop the line",
            ) from None
        except (
            OSError,
            ValueError,
            SyntaxError,
        ) as exc:  # missing, unreadable, not an image, a broken one
            raise ConfigError(
                "data.path",
                f"{CAPTIONS} line {caption.line}: cannot read {caption.image} as an "
                f"image ({exc.__class__.__name__}); replace the file or drop the line",
            ) from None


def encoder_patches(config: OptimusConfig, image: Image.Image) -> tuple[torch.Tensor, ...]:
    """``image`` as each encoder takes it: in its channels, resized to its patch grid, patchified
    (``image_patches``)."""
    return tuple(
        image_patches(
            image.convert(image_mode(e.in_channels)),
            e.patch_size,
            math.isqrt(e.seq_length),
            e.projector.spatial_merge,
        )
        for e in config.encoders
    )


def image_patches(
    image: Image.Image, patch_size: int, grid: int, spatial_merge: int = 1
) -> torch.Tensor:
    """``image`` resized to ``grid * patch_size`` pixels square, in [-1, 1], as ``[grid**2,
    patch_dim]``
    in ``patchify``'s order. Any fixed order works for the ViT (its patch and position embeddings
    are learned); the order only matters to the projector's spatial merge.
    """
    side = grid * patch_size
    resized = image.resize((side, side), Image.BICUBIC)
    channels = len(resized.getbands())
    pixels = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8).view(
        side, side, channels
    )
    patches = patchify(pixels.permute(2, 0, 1).unsqueeze(0), patch_size, spatial_merge)
    return (patches[0].float() / 255 - 0.5) / 0.5


def patchify(images: torch.Tensor, patch_size: int, spatial_merge: int = 1) -> torch.Tensor:
    """``[batch, channels, h, w]`` images as the encoder takes them, ``[batch, patches,
    patch_dim]``, each
    patch flattened channel-last. The patches are row-major over ``spatial_merge`` x
    ``spatial_merge`` blocks and row-major inside each, so the projector's merge groups are
    consecutive tokens (Qwen2-VL's order); ``spatial_merge`` 1 is plain row-major."""
    b, c, h, w = images.shape
    m, grid_h, grid_w = spatial_merge, h // patch_size, w // patch_size
    patches = images.reshape(b, c, grid_h // m, m, patch_size, grid_w // m, m, patch_size)
    # block row, block column, row, column, pixels, channel
    patches = patches.permute(0, 2, 5, 3, 6, 4, 7, 1)
    return patches.reshape(b, grid_h * grid_w, patch_size * patch_size * c)


def text_sequence(
    text: bytes, image_tokens: int, seq_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``seq_length + 1`` token ids (inputs are ``[:-1]``, labels ``[1:]``) and the loss mask.

    Image positions hold token 0 (their embeddings are replaced). The loss covers text positions
    whose label is a caption byte, so neither image positions nor padding count.
    """
    # the last text position's label is one byte further
    kept = text[: seq_length + 1 - image_tokens]
    sequence = torch.full((seq_length + 1,), PAD, dtype=torch.long)
    sequence[image_tokens : image_tokens + len(kept)] = torch.tensor(list(kept), dtype=torch.long)
    loss_mask = torch.zeros(seq_length)
    loss_mask[image_tokens : image_tokens + len(kept) - 1] = 1.0
    return sequence, loss_mask


def check_captions_dataset(config: OptimusConfig) -> None:
    """Validate a captions.jsonl ``data.path`` against the model without decoding images;
    ConfigError on the first problem: the folder, every line of captions.jsonl, that every image
    file exists, and that the model can take the data (square patch grids, 1 or 3 input channels, a
    vocabulary with all 256 bytes)."""
    _check_model(config)
    for caption in read_captions(Path(config.data.path)):
        if not caption.image.is_file():
            what = "is not a regular file" if caption.image.exists() else "does not exist"
            raise ConfigError(
                "data.path",
                f"{CAPTIONS} line {caption.line}: image {caption.image} {what}; add the file or "
                "drop the line",
            )


def _check_model(config: OptimusConfig) -> None:
    check_image_model(config)
    if config.llm.vocab_size < BYTE_VOCAB:
        raise ConfigError(
            "model.llm.vocab_size",
            f"{config.llm.vocab_size} is too small for the byte-level "
            f"captions of data.path; use at least {BYTE_VOCAB}",
        )


def check_image_model(config: OptimusConfig) -> None:
    """That every encoder can take images: a square patch grid its merge divides, 1 or 3
    channels."""
    for i, enc in enumerate(config.encoders):
        grid = math.isqrt(enc.seq_length)
        if grid * grid != enc.seq_length:
            raise ConfigError(
                f"model.encoders[{i}].seq_length",
                f"{enc.seq_length} is not a square number, "
                f"so images (data.path) cannot be cut into a square grid of patches; use e.g. "
                f"{grid * grid} or {(grid + 1) ** 2}",
            )
        if grid % enc.projector.spatial_merge:
            raise ConfigError(
                f"model.encoders[{i}].projector.spatial_merge",
                f"{enc.projector.spatial_merge} "
                f"does not divide the {grid}x{grid} patch grid of data.path's images, so the merge "
                f"groups are not whole blocks; use a divisor of {grid}",
            )
        if enc.in_channels not in _IMAGE_MODES:
            raise ConfigError(
                f"model.encoders[{i}].in_channels",
                f"{enc.in_channels} has no image format for "
                "data.path; use 3 (RGB) or 1 (grayscale)",
            )


def read_captions(root: Path) -> tuple[Caption, ...]:
    """Parse ``root/captions.jsonl``; ConfigError naming ``data.path`` (and the line) on any
    problem."""
    if not root.exists():
        raise ConfigError(
            "data.path",
            f"{root} does not exist; give a folder with {CAPTIONS} and images ({_SAMPLE_HINT})",
        )
    if not root.is_dir():
        raise ConfigError(
            "data.path", f"{root} is not a folder; give a folder with {CAPTIONS} and images"
        )
    path = root / CAPTIONS
    try:
        lines = read_regular_file(path).decode("utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(
            "data.path",
            f"{path} does not exist; write one JSON object per line, "
            f'{{"image": "images/000000.png", "text": "..."}} ({_SAMPLE_HINT})',
        ) from None
    except UnicodeDecodeError:
        raise ConfigError("data.path", f"{path} is not UTF-8 text; save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError("data.path", f"cannot read {path}: {exc.strerror}") from None
    captions = tuple(
        _parse_line(root, number, line) for number, line in enumerate(lines, 1) if line.strip()
    )
    if not captions:
        raise ConfigError(
            "data.path",
            f"{path} has no records; add lines like "
            '{"image": "images/000000.png", "text": "..."}',
        )
    return captions


def _parse_line(root: Path, number: int, line: str) -> Caption:
    where = f"{CAPTIONS} line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            "data.path",
            f"{where} is not valid JSON ({exc.msg}); write one object per line, "
            '{"image": "images/000000.png", "text": "..."}',
        ) from None
    if not isinstance(record, dict):
        raise ConfigError(
            "data.path", f'{where} is not a JSON object; write {{"image": ..., "text": ...}}'
        )
    for key in ("image", "text"):
        if not isinstance(record.get(key), str):
            raise ConfigError(
                "data.path",
                f'{where} has no string "{key}" field; give "image" (a path '
                'relative to data.path) and "text" (the caption)',
            )
    # JSON may escape a lone surrogate, which UTF-8 cannot hold
    text = record["text"].encode("utf-8", "replace")
    if len(text) < 2:  # the loss predicts each byte after the first, so a shorter caption has none
        raise ConfigError(
            "data.path",
            f'{where}: "text" {record["text"]!r} is too short; give a caption of '
            "at least 2 characters",
        )
    return Caption(number, root / record["image"], text)
