from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


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
