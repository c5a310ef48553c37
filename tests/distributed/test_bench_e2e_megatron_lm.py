"""benchmarks/bench_e2e.py's rows of Megatron-LM's own ``pretrain_vlm.py``, unmodified and with
``--optimus-schedule auto``, on a tiny job of 2 gloo ranks. Needs a checkout at tag
``core_v0.16.1`` named by ``MEGATRON_LM_DIR`` (skipped without); the rows' numbers are not checked
against each other here, only that both runs trained and were read."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from optimus_mllm.config import load_config

from support.paths import load_script

bench = load_script("bench_e2e")

# configs/cpu/pp2_v1_llava.yaml's shape at tiny sizes: PP2 V1, the ViT a copy of the LLM's layers
TINY_LLAVA = """\
name: tiny_llava
cluster: {num_gpus: 2, gpus_per_node: 2}
model:
  encoders:
    - {name: vit, num_layers: 2, hidden_size: 64, num_attention_heads: 4, ffn_hidden_size: 128,
       seq_length: 16, patch_size: 4, model_subtype: clip, class_token: true,
       drop_class_token: true, projector: {ffn_hidden_size: 128}}
  llm: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, ffn_hidden_size: 128,
        seq_length: 32, vocab_size: 256, untie_embeddings_and_output_weights: true}
training: {global_batch_size: 4, micro_batch_size: 1, precision: fp32, sequence_parallel: false,
           train_iters: 2}
parallel: {llm: {dp: 1, pp: 2, tp: 1, vp: 1}}
"""


@pytest.mark.distributed
@pytest.mark.skipif(
    bench.compare.megatron_lm_dir() is None,
    reason="MEGATRON_LM_DIR (a Megatron-LM checkout at core_v0.16.1) is unset",
)
def test_pretrain_vlm_trains_without_and_with_the_flag_into_two_rows(tmp_path: Path) -> None:
    path = tmp_path / "tiny_llava.yaml"
    path.write_text(TINY_LLAVA)
    flags = bench.script_flags(load_config(path))
    assert not isinstance(flags, str), flags
    # 2 iterations, the first left out as warm-up
    rows = bench.script_rows("tiny_llava", flags, 2, 2, None, tmp_path, warmup=1)
    assert [r.mode for r in rows] == [bench.SCRIPT, bench.SCRIPT_WITH_FLAG]
    for row in rows:
        assert row.problem is None, row
        assert row.measured_s is not None and row.measured_s > 0, row
        assert row.predicted_s is not None and row.predicted_s > 0, row
        assert row.steps == 2 and math.isfinite(row.loss), row
    plain, flagged = rows
    assert plain.said is None
    assert flagged.said is not None and flagged.said.startswith("optimus: --optimus-schedule auto")
