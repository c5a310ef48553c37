"""Multimodal samples from Megatron-Energon webdataset shards, tokenized and packed into sequences.

A sample (``scripts/make_sample_dataset.py`` writes them) is a ``KEY.json`` ``{"text": ...}``
whose text holds ``data.image_placeholder`` (``<image>``) where each image goes, and its images
``KEY.0.png``, ``KEY.1.png`` ... in the order of the placeholders: zero or more images, any size
Pillow reads. ``DIR/.nv-meta`` is what ``energon prepare`` writes; the samples are read with
energon's random-access tar reader over the ``train`` split's shards, in their order.

Text becomes token ids by ``data.tokenizer`` (a Hugging Face ``tokenizers`` directory holding
``tokenizer.json``, as Megatron's ``HuggingFaceTokenizer`` takes) or, without one, by UTF-8 bytes.
Each image takes ``config.image_tokens`` positions at its placeholder, whose embeddings the encoder
output replaces; every encoder sees each image resized to its own square resolution (``sqrt(
seq_length) * patch_size`` pixels), so a microbatch's encoder work is its number of images.

Packing: row r of the job's rows (``(iteration * microbatches + global microbatch) *
micro_batch_size + r``) is ``data.samples_per_sequence`` consecutive samples, ``(row * k + j) %
len(samples)``, laid end to end in one ``llm.seq_length`` sequence: a pure function of (iteration,
global microbatch, sample), so every rank, plan and resume sees the same rows. What does not fit is
cut, an image with all that follows it when its tokens would not fit whole. A position attends
only to earlier positions of its own sample, positions restart at 0 per sample, and the loss covers
the positions whose next token is text of the same sample, never an image token or padding.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from PIL import Image

from optimus_mllm.config import OptimusConfig
from optimus_mllm.config.files import ENERGON_META
from optimus_mllm.errors import ConfigError
from optimus_mllm.runtime.data import Microbatch, check_image_model, encoder_patches

PAD = 0  # token id of padding and of image positions (their embeddings are replaced)
IMAGE = -1  # an image position while a row is packed
BYTE_VOCAB = 256
# rows and samples kept: the encoder and LLM stages on one rank ask for the same microbatches
_CACHED = 256


# --------------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """Token ids 0-255: the text's UTF-8 bytes."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        # a lone surrogate, which JSON may hold, has no UTF-8
        return list(text.encode("utf-8", "replace"))


class HuggingFaceTokenizer:
    """A ``tokenizers`` tokenizer saved as ``DIR/tokenizer.json``; text only, no special tokens
    added (the placeholders are split off before it sees the text)."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = directory / "tokenizer.json"
        if not directory.is_dir():
            what = "does not exist" if not directory.exists() else "is not a folder"
            raise ConfigError(
                "data.tokenizer",
                f"{directory} {what}; give a Hugging Face tokenizer folder holding tokenizer.json",
            )
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception for missing and bad files
            raise ConfigError(
                "data.tokenizer",
                f"cannot read {path} as a Hugging Face tokenizer ({str(exc).splitlines()[0]}); "
                "save one with tokenizers' Tokenizer.save or a transformers tokenizer's "
                "save_pretrained",
            ) from None
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def load_tokenizer(config: OptimusConfig) -> Tokenizer:
    """``data.tokenizer``'s tokenizer, else UTF-8 bytes; checked against the LLM's vocabulary."""
    d = config.data
    if d.tokenizer is None:
        tokenizer, what = ByteTokenizer(), "the byte tokens of text without data.tokenizer"
    else:
        tokenizer, what = HuggingFaceTokenizer(Path(d.tokenizer)), f"data.tokenizer {d.tokenizer}"
    if config.llm.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            "model.llm.vocab_size",
            f"{config.llm.vocab_size} is too small for {what} ({tokenizer.vocab_size} ids); use at "
            f"least {tokenizer.vocab_size}",
        )
    return tokenizer


# --------------------------------------------------------------------------------------------
# Samples


@dataclass(frozen=True)
class Sample:
    key: str  # shard/key, for error messages
    text: str
    images: tuple[bytes, ...]  # encoded, in placeholder order


class EnergonSamples:
    """The ``train`` split's samples of an energon webdataset, by index."""

    def __init__(self, root: Path, placeholder: str) -> None:
        from megatron.energon.epathlib import EPath
        from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError
        from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
        from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

        self.placeholder = placeholder
        path = EPath(root.resolve())
        try:
            meta = WebdatasetMeta.from_config(path, split_part="train")
        except EmptyDatasetError:
            raise ConfigError(
                "data.path",
                f"{root} has no shards in its train split ({ENERGON_META}/split.yaml); add .tar "
                "shards and run energon prepare, or python scripts/make_sample_dataset.py --out "
                "DIR",
            ) from None
        except (OSError, ValueError, AssertionError) as exc:
            raise ConfigError(
                "data.path",
                f"{root}/{ENERGON_META} is not a prepared energon dataset with a train split "
                f"({exc.__class__.__name__}); run energon prepare on it",
            ) from None
        self._reader = ShardInfosITarReader(path, meta.shards)
        if len(self._reader) == 0:
            raise ConfigError(
                "data.path", f"{root}'s train split has no samples; add samples to its shards"
            )

    def __len__(self) -> int:
        return len(self._reader)

    def __getitem__(self, index: int) -> Sample:
        raw = self._reader[index]
        key = f"{raw['__shard__']}/{raw['__key__']}"
        try:
            text = json.loads(raw["json"])["text"]
            if not isinstance(text, str):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                "data.path",
                f'sample {key} has no KEY.json with a string "text"; write {{"text": ...}}',
            ) from None
        count = text.count(self.placeholder)
        names = [f"{i}.png" for i in range(count)]
        missing = [name for name in names if name not in raw]
        if missing:
            raise ConfigError(
                "data.path",
                f"sample {key} has {count} {self.placeholder} in its text but no "
                f"{raw['__key__']}.{missing[0]}; give one image per placeholder",
            )
        return Sample(key, text, tuple(raw[name] for name in names))


# --------------------------------------------------------------------------------------------
# Packing


@dataclass(frozen=True)
class PackedRow:
    """One LLM sequence of packed samples."""

    tokens: torch.Tensor  # [seq_length + 1]: inputs [:-1], labels [1:]; PAD at images and padding
    image_mask: torch.Tensor  # [seq_length] bool: the positions whose embedding is an image's
    loss_mask: torch.Tensor  # [seq_length]
    position_ids: torch.Tensor  # [seq_length]: from 0 in each sample
    segments: torch.Tensor  # [seq_length]: which packed sample a position is (padding: -1)
    images: tuple[tuple[int, int], ...]  # (sample index, its image) in position order


@dataclass(frozen=True)
class TokenizedSample:
    index: int  # in the dataset
    ids: tuple[int, ...]  # IMAGE at the image positions
    image_starts: tuple[int, ...]  # where each image's positions begin, in order


def tokenize_sample(
    index: int, sample: Sample, tokenizer: Tokenizer, placeholder: str, image_tokens: int
) -> TokenizedSample:
    """The sample's token ids with ``image_tokens`` positions at each placeholder."""
    ids: list[int] = []
    starts: list[int] = []
    for n, part in enumerate(sample.text.split(placeholder)):
        if n:
            starts.append(len(ids))
            ids += [IMAGE] * image_tokens
        ids += tokenizer.encode(part)
    return TokenizedSample(index, tuple(ids), tuple(starts))


def pack_row(samples: list[TokenizedSample], seq_length: int, image_tokens: int) -> PackedRow:
    """``samples`` laid end to end in ``seq_length + 1`` tokens (inputs and the last label).

    A cut falling inside an image's positions, or an image that would end past the inputs, moves
    the cut to the image's start: an image is whole or absent.
    """
    ids: list[int] = []
    segment: list[int] = []
    images: list[tuple[int, int, int]] = []  # (start, sample index, image)
    for number, sample in enumerate(samples):
        images += [(len(ids) + s, sample.index, k) for k, s in enumerate(sample.image_starts)]
        ids += sample.ids
        segment += [number] * len(sample.ids)
    keep = seq_length + 1
    whole = [image for image in images if image[0] + image_tokens <= seq_length]
    if len(whole) < len(images):
        keep = min(keep, images[len(whole)][0])
    pad = seq_length + 1 - len(ids[:keep])
    tokens = torch.tensor(ids[:keep] + [PAD] * pad, dtype=torch.long)
    segments = torch.tensor(segment[:keep] + [-1] * pad, dtype=torch.long)
    is_image = tokens == IMAGE
    text = ~is_image & (segments >= 0)
    loss_mask = text[:-1] & text[1:] & (segments[:-1] == segments[1:])
    tokens[is_image] = PAD
    positions = torch.arange(seq_length)
    first = torch.ones(seq_length, dtype=torch.bool)  # a sample's (or the padding's) first position
    first[1:] = segments[1:-1] != segments[:-2]
    segment_start = torch.cummax(torch.where(first, positions, 0), dim=0).values
    return PackedRow(
        tokens,
        is_image[:-1],
        loss_mask.float(),
        positions - segment_start,
        segments[:-1],
        tuple((index, k) for _, index, k in whole),
    )


def packed_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """megatron-core's boolean mask (True = masked), ``[batch, 1, seq, seq]``: causal within each
    packed sample, nothing across samples."""
    seq = segments.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    same = segments.unsqueeze(-1) == segments.unsqueeze(-2)
    return ~(causal & same).unsqueeze(1)


# --------------------------------------------------------------------------------------------
# The source


class WebdatasetSource:
    """An energon webdataset as a ``MicrobatchSource``, packed per ``data.samples_per_sequence``."""

    def __init__(self, config: OptimusConfig) -> None:
        if config.data.path is None:
            raise ValueError("WebdatasetSource needs config.data.path")
        check_image_model(config)
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.samples = EnergonSamples(Path(config.data.path), config.data.image_placeholder)
        self._tokenized = functools.lru_cache(maxsize=_CACHED)(self._tokenize)
        self._row = functools.lru_cache(maxsize=_CACHED)(self._packed_row)
        self._images = functools.lru_cache(maxsize=_CACHED)(self._decode)

    def rows(self, iteration: int, global_microbatch: int) -> list[PackedRow]:
        """The packed rows of microbatch ``global_microbatch`` of ``iteration``."""
        first = (
            iteration * self.config.num_microbatches_total + global_microbatch
        ) * self.config.training.micro_batch_size
        return [self._row(first + r) for r in range(self.config.training.micro_batch_size)]

    def image_count(self, iteration: int, global_microbatch: int) -> int:
        """The microbatch's images (its encoder batch), without decoding any."""
        return sum(len(row.images) for row in self.rows(iteration, global_microbatch))

    def __call__(self, iteration: int, global_microbatch: int) -> Microbatch:
        rows = self.rows(iteration, global_microbatch)
        sequence = torch.stack([row.tokens for row in rows])
        decoded = [self._images(index)[k] for row in rows for index, k in row.images]
        images = tuple(
            torch.stack([image[i] for image in decoded])
            if decoded
            else torch.empty(0, e.seq_length, e.in_channels * e.patch_size**2)
            for i, e in enumerate(self.config.encoders)
        )
        return Microbatch(
            images,
            sequence[:, :-1].contiguous(),
            sequence[:, 1:].contiguous(),
            torch.stack([row.loss_mask for row in rows]),
            torch.stack([row.position_ids for row in rows]),
            image_mask=torch.stack([row.image_mask for row in rows]),
            attention_mask=packed_attention_mask(torch.stack([row.segments for row in rows])),
        )

    def _tokenize(self, index: int) -> TokenizedSample:
        d = self.config.data
        sample = self.samples[index]
        if len(sample.images) > d.max_images_per_sample:
            raise ConfigError(
                "data.max_images_per_sample",
                f"sample {sample.key} has {len(sample.images)} images, more than the "
                f"{d.max_images_per_sample} planned for; raise it or drop the sample",
            )
        return tokenize_sample(
            index, sample, self.tokenizer, d.image_placeholder, self.config.image_tokens
        )

    def _packed_row(self, row: int) -> PackedRow:
        k = self.config.data.samples_per_sequence
        indices = [(row * k + j) % len(self.samples) for j in range(k)]
        return pack_row(
            [self._tokenized(i) for i in indices],
            self.config.llm.seq_length,
            self.config.image_tokens,
        )

    def _decode(self, index: int) -> list[tuple[torch.Tensor, ...]]:
        """Sample ``index``'s images, each as patches per encoder."""
        sample = self.samples[index]
        return [self._patches(sample, k, data) for k, data in enumerate(sample.images)]

    def _patches(self, sample: Sample, image: int, data: bytes) -> tuple[torch.Tensor, ...]:
        try:
            with Image.open(io.BytesIO(data)) as decoded:
                return encoder_patches(self.config, decoded)
        except Image.DecompressionBombError:
            raise ConfigError(
                "data.path",
                f"sample {sample.key}: image {image} has more than {2 * Image.MAX_IMAGE_PIXELS} "
                "pixels (Pillow's decompression-bomb limit); resize it or drop the sample",
            ) from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise ConfigError(
                "data.path",
                f"sample {sample.key}: cannot read image {image} ({exc.__class__.__name__}); "
                "replace it or drop the sample",
            ) from None
