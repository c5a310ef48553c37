"""Which reader a job's ``data.path`` takes: a Megatron-Energon webdataset (``webdataset_data``),
a folder with captions.jsonl (``data``), or none (synthetic data). Kept apart from both readers so
neither imports the other's module."""

from __future__ import annotations

import functools

from optimus_mllm.config import OptimusConfig
from optimus_mllm.config.files import is_webdataset
from optimus_mllm.errors import ConfigError
from optimus_mllm.runtime.data import (
    ImageCount,
    ImageTextDataset,
    MicrobatchSource,
    check_captions_dataset,
    synthetic_microbatch,
)
from optimus_mllm.runtime.webdataset_data import WebdatasetSource


def microbatch_source(config: OptimusConfig) -> MicrobatchSource:
    """Where the job's microbatches come from: the ``data.path`` dataset if set (an energon
    webdataset, or a folder with captions.jsonl), else synthetic data."""
    _check_tokenizer_use(config)
    if config.data.path is not None:
        if is_webdataset(config.data.path):
            return WebdatasetSource(config)
        return ImageTextDataset(config)
    return functools.partial(synthetic_microbatch, config)


def image_count(source: MicrobatchSource) -> ImageCount | None:
    """How many images each microbatch of ``source`` has, known without decoding them, where the
    count varies (a webdataset); None where it is always ``micro_batch_size``, one per sample."""
    return getattr(source, "image_count", None)


def check_dataset(config: OptimusConfig) -> None:
    """Validate ``data.path`` against the model without decoding images; ConfigError on the first
    problem (an energon webdataset: its metadata and tokenizer, ``WebdatasetSource``)."""
    _check_tokenizer_use(config)
    if config.data.path is None:
        return
    if is_webdataset(config.data.path):
        WebdatasetSource(config)
        return
    check_captions_dataset(config)


def _check_tokenizer_use(config: OptimusConfig) -> None:
    if config.data.tokenizer is not None and not is_webdataset(config.data.path):
        raise ConfigError(
            "data.tokenizer",
            "tokenizes the text of an energon webdataset (data.path with .nv-meta); captions.jsonl "
            "and synthetic data use byte tokens: drop data.tokenizer or give such a data.path",
        )
