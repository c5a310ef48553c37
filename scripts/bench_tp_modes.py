"""METP against Megatron's 1D TP+SP in the project's memory model: the METP paper's experiments
simulated, ours next to theirs (issue 37), and the same question for a ViT inside an Optimus plan.

    python scripts/bench_tp_modes.py [--json OUT]

Four tables, no torch, no GPU:

1. ``sequence``: the paper's models (Liang et al., Table 3: hidden size, heads, layers per device)
   on 8 ranks of an A100-SXM4-80GB (§5.1): the longest sequence (batch 1, a multiple of 64 tokens)
   whose model states and saved activations fit 80 GiB under 1D TP+SP and under METP, and their
   ratio, next to the paper's 2.38-2.99x (§5.5; the per-model bars of its Fig. 6 are not in the
   text). Model states are the memory model's (bf16 parameters, fp32 main gradients, Adam with an
   fp32 master copy: 18 bytes a parameter, no data parallelism to shard them), parameters per rank
   from ``tp_memory.layer_bytes``. Activations are ``memory_model.mode_layer_activation_bytes``:
   Korthikanti et al.'s 1D figure with selective recomputation (no s x s scores kept: what the
   paper's FlashAttention baseline keeps) and METP's runtime layer (``metp_memory``). The FFN is
   the paper's h -> 4h -> h with biases and LayerNorm (its Table 1), not LLaMA's gated 11008/28672.
   Embeddings, the output layer and one layer's transient forward peak are left out, as the
   planner leaves them out. Under it, GPT-175B's bytes at 512k tokens, METP over 1D, next to the
   paper's "up to 64%" less (§5.3, Fig. 4).
2. ``peak``: per-layer activation bytes METP over 1D at p = 2 and 4 (ours: the memory model's,
   LLaMA-7B at 32k tokens) next to the paper's Eq. 10 (peak intermediates of attention with
   FlashAttention, >= 41.7 % saving at p = 2).
3. ``vit``: ``configs/metp_long_vision.yaml`` (a ViT-L next to a 7B LLM at DP1 PP4 TP2 on 8 GPUs of
   80 GiB) at growing square image sides in 14-pixel patches: whether the planner
   (``planner.plan``) keeps an encoder plan under ``parallel.encoder.tp_mode`` 1d and metp, at the
   config's ``recompute: none`` (1d keeps the s x s scores) and at ``recompute: selective``, and
   the largest side that fits in each. The sweep merges 4 x 4 patches into one LLM token (the
   config: 2 x 2), so that the LLM's 4096 tokens leave text room up to a 3472 px image.
4. ``grid``: the 2D and 3D papers' 64 GPUs: one layer's per-rank bytes under 1d, 2d and 3d at the
   2D paper's 64-GPU model, and how many more sequences a mode keeps per byte than 1D, next to the
   2D paper's 8x larger batch (§5.3). Both papers' speed-ups are times, not simulated here.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from optimus_mllm.config import TPMode, TransformerSpec
from optimus_mllm.config.loader import config_from_dict
from optimus_mllm.errors import ConfigError
from optimus_mllm.io_utils import atomic_write_text
from optimus_mllm.memory_model import (
    ACTIVATION_BYTES,
    GIB,
    MAIN_GRAD_BYTES,
    PARAM_BYTES,
    mode_layer_activation_bytes,
)
from optimus_mllm.metp_memory import paper_attention_ratio
from optimus_mllm.planner import plan
from optimus_mllm.tp_memory import layer_bytes

ROOT = Path(__file__).resolve().parent.parent
VIT_CONFIG = ROOT / "configs" / "metp_long_vision.yaml"

PAPER_GPUS = 8
PAPER_GPU_GIB = 80  # A100-SXM4-80GB (§5.1)
PAPER_GAIN = "2.38-2.99x (§5.5, all models)"
# bf16 parameter, fp32 main gradient, Adam's fp32 master copy and two moments
# (memory_model.optimizer_bytes_per_param at bf16 with Adam); one data-parallel replica
STATE_BYTES_PER_PARAM = PARAM_BYTES["bf16"] + MAIN_GRAD_BYTES + 4 + 8
SEQUENCE_GRANULE = 64  # METP at p = 8 tiles the sequence p^2 ways
PEAK_CASE_TOKENS = 32768
PATCH_PIXELS = 14
# encoder TP mode under the config's recompute: none (1d keeps megatron-core's local attention's
# s x s probabilities), then both under recompute: selective (1d keeps no scores, as with
# FlashAttention; the LLM, 1d in all, shrinks alike)
VIT_VARIANTS = ("1d", "metp", "1d-selective", "metp-selective")
# 4 x 4 patches an LLM token, so that the LLM's 4096 tokens hold up to a 3584 px image (the
# config's 2 x 2 stops at 1764 px, before memory stops METP)
VIT_MERGE = 4
VIT_SIDES = range(16, 257, 32)
GRID_GPUS = 64
GRID_BATCH = 64  # divides over 2D's 8 grid rows and 3D's 16 y-z planes


@dataclass(frozen=True)
class PaperModel:
    """A row of the METP paper's Table 3."""

    name: str
    hidden: int
    heads: int
    layers_per_device: int


PAPER_MODELS = (
    PaperModel("BERT-Large", 1024, 16, 24),
    PaperModel("LLaMA-7B", 4096, 32, 32),
    PaperModel("LLaMA-70B", 8192, 64, 5),
    PaperModel("GPT-175B", 12288, 96, 1),
)


def layer_spec(model: PaperModel, seq: int) -> TransformerSpec:
    """The paper's layer (its Table 1 FFN of 4h, biases, LayerNorm) at ``seq`` tokens."""
    return TransformerSpec(
        num_layers=model.layers_per_device,
        hidden_size=model.hidden,
        num_attention_heads=model.heads,
        ffn_hidden_size=4 * model.hidden,
        seq_length=seq,
    )


def rank_bytes(model: PaperModel, mode: TPMode, p: int, seq: int) -> float:
    """Model states and saved activations of ``model``'s layers on one of ``p`` ranks, batch 1."""
    spec = layer_spec(model, seq)
    params = layer_bytes(spec, mode, p, 1, element_bytes=1).parameters
    recompute = "selective" if mode == "1d" else "none"
    activations = mode_layer_activation_bytes(spec, 1, p, mode, True, recompute)
    return model.layers_per_device * (STATE_BYTES_PER_PARAM * params + activations)


def max_sequence(model: PaperModel, mode: TPMode, p: int, capacity: float) -> int:
    """The longest multiple of ``SEQUENCE_GRANULE`` tokens that fits ``capacity`` bytes (0 if
    none); the bytes grow with the length, so a bisection finds it."""
    lo, hi = 0, 1
    while rank_bytes(model, mode, p, hi * SEQUENCE_GRANULE) <= capacity:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if rank_bytes(model, mode, p, mid * SEQUENCE_GRANULE) <= capacity:
            lo = mid
        else:
            hi = mid
    return lo * SEQUENCE_GRANULE


def sequence_rows(
    models: tuple[PaperModel, ...] = PAPER_MODELS,
    p: int = PAPER_GPUS,
    gpu_gib: float = PAPER_GPU_GIB,
) -> list[dict[str, Any]]:
    """Table 1: each model's longest sequence under 1d and metp, and their ratio."""
    rows = []
    for model in models:
        one_d = max_sequence(model, "1d", p, gpu_gib * GIB)
        metp = max_sequence(model, "metp", p, gpu_gib * GIB)
        rows.append(
            {
                "model": model.name,
                "hidden": model.hidden,
                "heads": model.heads,
                "layers": model.layers_per_device,
                "max_seq_1d": one_d,
                "max_seq_metp": metp,
                "gain": metp / one_d if one_d else None,
                "paper_gain": PAPER_GAIN,
            }
        )
    return rows


def peak_rows(model: PaperModel = PAPER_MODELS[1], seq: int = PEAK_CASE_TOKENS) -> list[dict]:
    """Table 2: one layer's activation bytes, METP over 1D TP+SP, at p = 2 and 4."""
    spec = layer_spec(model, seq)
    rows = []
    for p in (2, 4):
        one_d = mode_layer_activation_bytes(spec, 1, p, "1d", True, "selective")
        metp = mode_layer_activation_bytes(spec, 1, p, "metp", True, "none")
        rows.append(
            {
                "p": p,
                "model": model.name,
                "seq": seq,
                "ratio": metp / one_d,
                "paper_eq10_ratio": paper_attention_ratio(p),
            }
        )
    return rows


def memory_ratio(model: PaperModel, seq: int, p: int = PAPER_GPUS) -> dict[str, Any]:
    """A rank's bytes under METP over 1D TP+SP at ``seq`` tokens, next to the paper's Fig. 4
    figure for GPT-175B at 512k tokens (METP "reduced the memory consumption ... by up to 64%",
    §5.3): a ratio of 0.36."""
    ours = rank_bytes(model, "metp", p, seq) / rank_bytes(model, "1d", p, seq)
    return {"model": model.name, "seq": seq, "ratio": ours, "paper_ratio": 1 - 0.64}


def grid_rows(batch: int = GRID_BATCH) -> list[dict[str, Any]]:
    """Table 4: one layer of the 2D paper's 64-GPU model (its Table 2: h 8192, 128 heads, s 512,
    the FFN of 4h) on 64 ranks under 1d, 2d (8 x 8) and 3d (4 x 4 x 4), from
    ``tp_memory.layer_bytes`` at 16 bits: parameters, the activations that do not grow with the
    batch (3D's all-gathered weights) and those added per sequence (the slope between ``batch``
    and twice it), and 1D's per-sequence bytes over the mode's."""
    spec = TransformerSpec(
        num_layers=24,
        hidden_size=8192,
        num_attention_heads=128,
        ffn_hidden_size=4 * 8192,
        seq_length=512,
    )
    per_sequence = {}
    rows = []
    for mode in ("1d", "2d", "3d"):
        one = layer_bytes(spec, mode, GRID_GPUS, batch, ACTIVATION_BYTES)
        two = layer_bytes(spec, mode, GRID_GPUS, 2 * batch, ACTIVATION_BYTES)
        per_sequence[mode] = (two.activations - one.activations) / batch
        rows.append(
            {
                "mode": mode,
                "gpus": GRID_GPUS,
                "parameter_bytes": one.parameters,
                "fixed_activation_bytes": one.activations - batch * per_sequence[mode],
                "activation_bytes_per_sequence": per_sequence[mode],
                "sequences_vs_1d": per_sequence["1d"] / per_sequence[mode],
            }
        )
    return rows


def vit_config(raw: dict[str, Any], variant: str, side: int, merge: int) -> Any:
    """``raw`` (the ViT config's YAML) with the encoder under ``variant`` (a TP mode, with
    ``-selective``: and training.recompute selective) at ``side`` x ``side`` patches, merged
    ``merge`` x ``merge`` into LLM tokens."""
    changed = copy.deepcopy(raw)
    changed["parallel"]["encoder"]["tp_mode"] = variant.removesuffix("-selective")
    if variant.endswith("-selective"):
        changed["training"]["recompute"] = "selective"
    encoder = changed["model"]["encoders"][0]
    encoder["seq_length"] = side * side
    encoder["projector"]["spatial_merge"] = merge
    return config_from_dict(changed, VIT_CONFIG.parent)


def encoder_status(raw: dict[str, Any], variant: str, side: int, merge: int) -> str:
    """``fits`` where the planner keeps an encoder plan; else ``OOM`` where memory pruned one,
    ``no text room`` where the image leaves the LLM no text, ``no plan`` where the config or every
    plan is refused for its shape (tokens that do not split into whole merge groups)."""
    try:
        config = vit_config(raw, variant, side, merge)
    except ConfigError as error:
        return "no text room" if "no room for text" in str(error) else "no plan"
    result = plan(config)
    if result.candidates:
        return "fits"
    if any(p.reason.startswith("out of memory") for p in result.pruned):
        return "OOM"
    return "no plan"


def vit_rows(merge: int = VIT_MERGE, sides: range = VIT_SIDES) -> dict[str, Any]:
    """Table 3: per image side (in patches), the planner's answer under each of
    ``VIT_VARIANTS``; and per variant the largest side that fits and why the next one that is
    not merely misshapen does not."""
    raw = yaml.safe_load(VIT_CONFIG.read_text())
    rows = [
        {"pixels": side * PATCH_PIXELS, "tokens": side * side}
        | {v: encoder_status(raw, v, side, merge) for v in VIT_VARIANTS}
        for side in sides
    ]
    largest = {}
    for variant in VIT_VARIANTS:
        status = {s: encoder_status(raw, variant, s, merge) for s in range(2, sides.stop, 2)}
        best = max((s for s, v in status.items() if v == "fits"), default=0)
        beyond = [v for s, v in status.items() if s > best and v in ("OOM", "no text room")]
        largest[variant] = {
            "pixels": best * PATCH_PIXELS,
            "above": beyond[0] if beyond else None,
        }
    return {"merge": merge, "rows": rows, "largest": largest}


def print_tables(
    sequence: list[dict], memory: dict[str, Any], peak: list[dict], vit: dict[str, Any]
) -> None:
    print(f"Longest sequence on {PAPER_GPUS} x {PAPER_GPU_GIB} GiB, batch 1 (METP Table 3 models)")
    print(
        f"{'model':<11} {'h':>6} {'n':>3} {'L':>3} {'1D TP+SP':>10} {'METP':>10} {'gain':>6}  paper"
    )
    for r in sequence:
        print(
            f"{r['model']:<11} {r['hidden']:>6} {r['heads']:>3} {r['layers']:>3} "
            f"{r['max_seq_1d']:>10} {r['max_seq_metp']:>10} {r['gain']:>5.2f}x  {r['paper_gain']}"
        )
    print(
        f"{memory['model']} at {memory['seq']} tokens, bytes METP / 1D TP+SP: "
        f"ours {memory['ratio']:.3f}, paper {memory['paper_ratio']:.2f} (Fig. 4: 64 % less)"
    )
    print()
    print("One layer's activations, METP / 1D TP+SP (ours) vs the paper's Eq. 10 peak ratio")
    print(f"{'p':>2} {'case':<17} {'ours':>6} {'paper':>6}")
    for r in peak:
        case = f"{r['model']} s={r['seq']}"
        print(f"{r['p']:>2} {case:<17} {r['ratio']:>6.3f} {r['paper_eq10_ratio']:>6.3f}")
    print("paper: >= 41.7 % saving at p = 2 (Eq. 10, attention with FlashAttention)")
    print()
    print(
        f"ViT-L encoder plans in {VIT_CONFIG.name} (planner.plan), by image side, "
        f"spatial_merge {vit['merge']}"
    )
    print(f"{'pixels':>6} {'tokens':>6}" + "".join(f" {v:>14}" for v in VIT_VARIANTS))
    for r in vit["rows"]:
        print(f"{r['pixels']:>6} {r['tokens']:>6}" + "".join(f" {r[v]:>14}" for v in VIT_VARIANTS))
    for variant, best in vit["largest"].items():
        print(f"largest that fits under {variant}: {best['pixels']} px (above it: {best['above']})")


def print_grid(grid: list[dict]) -> None:
    print("One layer of the 2D paper's 64-GPU model (h 8192, 128 heads, s 512), MiB per rank")
    print(f"{'mode':<5} {'params':>7} {'fixed act':>9} {'act/seq':>8} {'seqs vs 1d':>10}")
    for r in grid:
        print(
            f"{r['mode']:<5} {r['parameter_bytes'] / 2**20:>7.2f} "
            f"{r['fixed_activation_bytes'] / 2**20:>9.2f} "
            f"{r['activation_bytes_per_sequence'] / 2**20:>8.3f} {r['sequences_vs_1d']:>9.2f}x"
        )
    print("paper: 2D's largest batch 8x Megatron's on 64 GPUs (2D §5.3, Fig. 9, with activation")
    print("checkpointing); 3D 2.32x and 1.57x faster than 1D and 2D (3D Table 2): time, not here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    args = parser.parse_args(argv)
    if args.json and not Path(args.json).parent.is_dir():
        print(
            f"bench_tp_modes: error: --json: directory {Path(args.json).parent} does not exist; "
            "create it or choose another path",
            file=sys.stderr,
        )
        return 2
    sequence, peak, vit = sequence_rows(), peak_rows(), vit_rows()
    memory = memory_ratio(PAPER_MODELS[3], 512 * 1024)
    grid = grid_rows()
    print_tables(sequence, memory, peak, vit)
    print()
    print_grid(grid)
    if args.json:
        results = {"sequence": sequence, "memory": memory, "peak": peak, "vit": vit, "grid": grid}
        atomic_write_text(args.json, json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
