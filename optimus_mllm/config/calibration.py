"""Calibrations: the cost model's constants and the recompute mode as one named input.

``cost_model.calibration`` names one. ``roofline`` (the default) keeps the config's own
``cost_model`` section and ``training.recompute``; any other name is a YAML file in
``optimus_mllm/config/calibrations/`` (or a path to one) whose ``cost_model`` entries and
``recompute`` replace the config's. ``paper`` is fitted to the Optimus paper's Tables 5 and 7 by
``scripts/fit_calibration.py``, which writes the file with its fit and residuals at the top; rerun
it to reproduce the constants. A kernel profile measured by ``optimus-profile``
(``cost_model.profile``) replaces both for every kernel it times.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimus_mllm.config.yaml_input import YAMLInputError, read_yaml_file
from optimus_mllm.errors import ConfigError

CALIBRATIONS = Path(__file__).resolve().parent / "calibrations"
ROOFLINE = "roofline"
# the cost_model entries a calibration may set
CONSTANTS = (
    "gemm_efficiency",
    "attention_efficiency",
    "memory_efficiency",
    "network_efficiency",
    "nvlink_efficiency",
    "kernel_overhead_us",
)
RECOMPUTE = ("none", "selective", "full")
FIELD = "cost_model.calibration"


@dataclass(frozen=True)
class Calibration:
    name: str
    constants: dict[str, float]  # cost_model entry -> value
    recompute: str | None = None  # None: the config's


def calibration_path(name: str) -> Path:
    """The file a calibration name stands for: a shipped one by name, else a path."""
    shipped = CALIBRATIONS / f"{name}.yaml"
    return shipped if shipped.is_file() else Path(name)


def load_calibration(name: str) -> Calibration | None:
    """The named calibration; None for ``roofline`` (the config's own constants)."""
    if name == ROOFLINE:
        return None
    path = calibration_path(name)
    shipped = ", ".join(sorted([ROOFLINE] + [p.stem for p in CALIBRATIONS.glob("*.yaml")]))
    try:
        raw = read_yaml_file(path)
    except (OSError, YAMLInputError):
        raise ConfigError(
            FIELD, f"no calibration {name!r}; use one of {shipped} or a calibration YAML file"
        ) from None
    return _parse(name, raw)


def _parse(name: str, raw: Any) -> Calibration:
    if not isinstance(raw, dict) or not isinstance(raw.get("cost_model", {}), dict):
        raise ConfigError(FIELD, f"{name}: needs a cost_model mapping and an optional recompute")
    constants = {}
    for key, value in raw.get("cost_model", {}).items():
        if key not in CONSTANTS or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(
                FIELD, f"{name}: cost_model.{key} must be one of {', '.join(CONSTANTS)}, a number"
            )
        constants[key] = float(value)
    recompute = raw.get("recompute")
    if recompute is not None and recompute not in RECOMPUTE:
        raise ConfigError(FIELD, f"{name}: recompute must be one of {', '.join(RECOMPUTE)}")
    return Calibration(name, constants, recompute)
