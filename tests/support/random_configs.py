"""Random scheduler configs the scheduler tests and the lower-bound tests draw from: a seed gives
one config, as a mapping ``load_config`` takes."""

from __future__ import annotations

import random


def random_config(seed: int) -> dict:
    rng = random.Random(seed)
    tp = rng.choice([1, 2, 4])
    pp = rng.choice([1, 2, 4])
    dp = rng.choice([1, 2])
    n = tp * pp * dp
    vp = rng.choice([1, 2]) if pp > 1 else 1
    heads = 4 * rng.choice([1, 2])
    layers = pp * vp * rng.choice([1, 2])
    per_pipeline = pp * rng.choice([1, 2, 3])
    mbs = rng.choice([1, 2])
    encoders = []
    for i in range(rng.choice([1, 1, 2])):
        enc_heads = rng.choice([4, 8])
        encoders.append(
            {
                "name": f"enc{i}",
                "num_layers": rng.choice([1, 2, 3, 4]),
                "hidden_size": 16 * enc_heads,
                "num_attention_heads": enc_heads,
                "ffn_hidden_size": 64 * enc_heads,
                "seq_length": rng.choice([16, 64, 256]),
                "patch_size": 4,
                "frozen": rng.random() < 0.25,
            }
        )
    return {
        "name": f"random{seed}",
        "cluster": {
            "num_gpus": n,
            "gpus_per_node": max(4, tp),
            "gpu_memory_gib": 80,
            "inter_node_bandwidth_gbps": rng.choice([5.0, 50.0]),
        },
        "model": {
            "encoders": encoders,
            "llm": {
                "num_layers": layers,
                "hidden_size": 32 * heads,
                "num_attention_heads": heads,
                "ffn_hidden_size": 128 * heads,
                "seq_length": 1024,
                "vocab_size": 1024,
            },
        },
        "training": {
            "global_batch_size": per_pipeline * dp * mbs,
            "micro_batch_size": mbs,
            "sequence_parallel": rng.random() < 0.5,
            "recompute": rng.choice(["none", "selective"]),
        },
        "parallel": {"llm": {"dp": dp, "pp": pp, "tp": tp, "vp": vp}},
        "planner": {"max_partitions": 8},
    }


def heavy_random_config(seed: int) -> dict:
    """``random_config(seed)`` with wider, deeper encoders on more tokens (often heavier than the
    LLM)."""
    raw = random_config(seed)
    rng = random.Random(1000 + seed)
    for enc in raw["model"]["encoders"]:
        heads = rng.choice([4, 8, 16])
        enc.update(
            num_layers=rng.choice([2, 4, 8]),
            hidden_size=64 * heads,
            num_attention_heads=heads,
            ffn_hidden_size=256 * heads,
            seq_length=rng.choice([128, 256]),
        )
    return raw
