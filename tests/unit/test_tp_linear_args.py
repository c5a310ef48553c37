"""The 2D and 3D linears' reading of megatron-core's linear keywords (``tp_modes.linear_args``)."""

from __future__ import annotations

import pytest

from optimus_mllm.runtime.tp_modes.linear_args import linear_args


@pytest.mark.parametrize(
    "unbuilt",
    [{"gather_output": True}, {"input_is_parallel": False}, {"stride": 2}, {"is_expert": True}],
)
@pytest.mark.parametrize("layer, mode", [("Linear2D", "2D"), ("Linear3D", "3D")])
def test_unbuilt_layouts_are_refused_in_one_line(
    unbuilt: dict[str, object], layer: str, mode: str
) -> None:
    with pytest.raises(ValueError) as refused:
        linear_args(layer, mode, unbuilt)
    assert str(refused.value) == (
        f"{layer}: gather_output, unpartitioned input, stride > 1 and experts are not built in"
        f" {mode} tensor parallelism"
    )


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="sequence_parallel"):
        linear_args("Linear3D", "3D", {"sequence_parallel": True})
