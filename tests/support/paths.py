"""Where the tests find the repository and its configs, and configs the tests share."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


# heavy_random_config(174) (support.random_configs) with untied embeddings and 2 steps, its ViT
# widened to 1024 (4x the LLM) since whole kernels pay for their waves: on 2 GPUs the cost model
# prices the balanced baseline 1074 us against Optimus's best 1090 us.
BALANCED_WINS = (
    "name: balanced_wins\n"
    "cluster: {num_gpus: 2, gpus_per_node: 4, gpu_memory_gib: 80, inter_node_bandwidth_gbps: 5.0}\n"
    "model:\n"
    "  encoders: [{name: enc0, num_layers: 4, hidden_size: 1024, num_attention_heads: 4, "
    "ffn_hidden_size: 4096,\n"
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


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` or ``benchmarks/NAME.py`` loaded from its file, as ``python
    scripts/NAME.py`` runs it (scripts and benchmarks are programs, not packages), for the tests of
    what a script itself defines."""
    folder = "benchmarks" if (REPO / "benchmarks" / f"{name}.py").is_file() else "scripts"
    path = REPO / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


# configs/pretrain_vlm_tiny.yaml as Megatron-LM flags (pretrain_vlm.py's conventions): a ViT of 2
# layers and an LLM of 4 at TP2 PP2 with two model chunks per stage, untied embeddings, the
# distributed optimizer, CLIP's class token dropped before the projector; dropout stays Megatron's
# 0.1
MEGATRON_TINY_LAYERS = ("--encoder-num-layers", "2", "--decoder-num-layers", "4")
MEGATRON_TINY_FLAGS = (
    *MEGATRON_TINY_LAYERS,
    *("--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "256"),
    *("--seq-length", "48", "--max-position-embeddings", "64"),
    *("--img-h", "16", "--img-w", "16", "--patch-dim", "4"),
    *("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
    *("--num-layers-per-virtual-pipeline-stage", "1"),
    *("--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "3", "--lr", "1e-4"),
    *("--transformer-impl", "local", "--untie-embeddings-and-output-weights"),
    *("--use-distributed-optimizer", "--disable-vision-class-token"),
)
