"""Dropout masks: the configured fraction, cut from the unsharded tensor's mask, and for the LLM a
pure function of the seed set before a forward step (so no schedule order changes them).

That the encoder's masks are the same under every encoder plan and in a recomputed forward is
checked in test_encoder_ops (``dropout-full``); that Optimus and the baseline draw the same masks
end to end, in test_runtime."""

from __future__ import annotations

import pytest
import torch

from optimus_mllm.config import load_config
from optimus_mllm.errors import ConfigError
from optimus_mllm.runtime.dropout import dropout

from support.distributed_utils import run_distributed
from support.train_utils import TINY

ONE_RANK = [
    "cluster.num_gpus=1",
    "cluster.gpus_per_node=1",
    "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}",
]


def test_dropout_zeroes_about_p_and_scales_the_rest():
    x = torch.ones(200, 50, 10)
    out = dropout(x, 0.3, seed=7, whole=tuple(x.shape))
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.01
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / 0.7))
    assert torch.equal(dropout(x, 0.3, seed=7, whole=tuple(x.shape)), out), (
        "the seed decides the mask"
    )
    assert not torch.equal(dropout(x, 0.3, seed=8, whole=tuple(x.shape)), out)
    assert dropout(x, 0.0, seed=7, whole=tuple(x.shape)) is x


@pytest.mark.parametrize("dim", [0, 1])
def test_a_shards_mask_is_its_part_of_the_whole_mask(dim: int):
    whole = torch.randn(8, 6, 4)
    expected = dropout(whole, 0.5, seed=3, whole=tuple(whole.shape))
    parts = [
        dropout(shard, 0.5, seed=3, whole=tuple(whole.shape), dim=dim, parts=2, part=i)
        for i, shard in enumerate(whole.chunk(2, dim=dim))
    ]
    assert torch.equal(torch.cat(parts, dim=dim), expected)


def test_a_dropout_probability_of_one_is_refused():
    with pytest.raises(ConfigError, match=r"model\.encoders\[0\]\.attention_dropout.*\[0, 1\)"):
        load_config(TINY, ["model.encoders.0.attention_dropout=1.0"])
    with pytest.raises(ConfigError, match=r"model\.llm\.hidden_dropout"):
        load_config(TINY, ["model.llm.hidden_dropout=-0.1"])


def _llm_losses(overrides: list[str]) -> dict[str, float]:
    """One rank: the LLM's loss on one microbatch after seeding its dropout from seeds 1, 1 (after
    other
    draws from the default generator, as an encoder op at a hook point might make) and 2."""
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.dropout import seed_llm_dropout
    from optimus_mllm.runtime.llm import causal_mask
    from optimus_mllm.runtime.trainer import Trainer

    config = load_config(TINY, ONE_RANK + overrides)
    trainer = Trainer(config, plan(config).llm_plan, "baseline")
    chunk, mb = trainer.chunks[0], trainer.data(0, 0)

    def loss(seed: int) -> float:
        seed_llm_dropout(seed, 0)
        per_token = chunk(
            mb.tokens, mb.position_ids, causal_mask(config.llm.seq_length), labels=mb.labels
        )
        return per_token.mean().item()

    first = loss(1)
    torch.rand(1000)
    losses = {"first": first, "again": loss(1), "other seed": loss(2)}
    trainer.close()
    return losses


def _llm_losses_off_and_on() -> tuple[dict[str, float], dict[str, float]]:
    return _llm_losses([]), _llm_losses(
        ["model.llm.hidden_dropout=0.2", "model.llm.attention_dropout=0.2"]
    )


@pytest.mark.distributed
def test_llm_dropout_is_the_seeds_alone():
    ((off, on),) = run_distributed(_llm_losses_off_and_on, 1, timeout=120)
    assert off["first"] == off["again"] == off["other seed"]
    assert on["first"] == on["again"]
    assert on["other seed"] != on["first"]
    assert on["first"] != off["first"]
