from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


# _heavy_random_config(174) of test_scheduler with untied embeddings and 2 steps: a ViT as wide as
# the LLM on 2 GPUs, where the cost model prices the balanced baseline 546 us against Optimus's best
# 569 us.
BALANCED_WINS = (
    "name: balanced_wins\n"
    "cluster: {num_gpus: 2, gpus_per_node: 4, gpu_memory_gib: 80, inter_node_bandwidth_gbps: 5.0}\n"
    "model:\n"
    "  encoders: [{name: enc0, num_layers: 4, hidden_size: 256, num_attention_heads: 4, "
    "ffn_hidden_size: 1024,\n"
    "              seq_length: 256, patch_size: 4}]\n"
    "  llm: {num_layers: 4, hidden_size: 256, num_attention_heads: 8, ffn_hidden_size: 1024, "
    "seq_length: 1024,\n"
    "        vocab_size: 1024, untie_embeddings_and_output_weights: true}\n"
    "training: {global_batch_size: 2, micro_batch_size: 1, recompute: selective, train_iters: 2}\n"
    "parallel: {llm: {dp: 1, pp: 2, tp: 1, vp: 2}}\n"
)


def balanced_wins(folder: Path) -> Path:
    """``BALANCED_WINS`` written into ``folder``."""
    path = folder / "balanced_wins.yaml"
    path.write_text(BALANCED_WINS)
    return path


@pytest.fixture
def tiny_raw() -> dict[str, Any]:
    """The tiny config as a mutable mapping."""
    return copy.deepcopy(yaml.safe_load((CONFIGS / "tiny.yaml").read_text()))


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a mapping as YAML next to a copy of the model zoo and return its path."""

    def write(raw: dict[str, Any], name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    return write
