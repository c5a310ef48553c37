"""A small Hugging Face tokenizer trained at test time (nothing is downloaded), saved as a folder
holding ``tokenizer.json`` as Megatron's ``HuggingFaceTokenizer`` takes it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers


def train_tokenizer(texts: Iterable[str], out: Path, vocab_size: int = 200) -> Path:
    """A byte-level BPE tokenizer learnt from ``texts``, saved in the new folder ``out``."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<unk>"])
    tokenizer.train_from_iterator(texts, trainer)
    out.mkdir(parents=True)
    tokenizer.save(str(out / "tokenizer.json"))
    return out
