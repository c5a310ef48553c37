"""The names of the placements optimus-train runs, as the CLI picks them and a checkpoint records
them (``meta.json``'s ``mode``). No torch: the launcher checks a checkpoint against the job before
any rank imports megatron-core. ``runtime.placements`` holds what each one does.
"""

from __future__ import annotations

from typing import Literal, get_args

# Optimus's schedule, the Megatron-style baseline (Megatron-LM's placement: the encoders whole in
# the first pipeline stage), the paper's Megatron-LM balanced baseline
Mode = Literal["optimus", "baseline", "balanced"]
MODES: tuple[Mode, ...] = get_args(Mode)
