"""Loading a config: read the YAML, merge model ``base`` files, apply ``key.path=value``
overrides, build the typed dataclasses (``typed_load``), apply the calibration, validate.

A model section (``model.llm`` or one entry of ``model.encoders``) may name a ``base`` YAML file,
relative to the file that names it; the section's own keys override the base's. The model zoo in
``configs/models/`` is used this way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from optimus_mllm.config.calibration import load_calibration
from optimus_mllm.config.schema import ModelConfig, OptimusConfig
from optimus_mllm.config.typed_load import load_typed
from optimus_mllm.config.validation import validate
from optimus_mllm.config.yaml_input import YAMLInputError, parse_yaml, read_yaml_file
from optimus_mllm.errors import ConfigError


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> OptimusConfig:
    """Read, merge ``base`` files, apply ``key.path=value`` overrides, type-check and validate."""
    path = Path(path)
    raw = _read_yaml(path, "--config")
    if not isinstance(raw, dict):
        raise ConfigError(
            "config", f"{path} must hold a mapping at top level, got {type(raw).__name__}"
        )
    raw = _resolve_model_bases(raw, path.parent)
    for item in overrides:
        _apply_override(raw, item)
    raw["source"] = str(path)
    config = calibrate(load_typed(OptimusConfig, raw, ""))
    validate(config)
    return config


def config_from_dict(raw: dict[str, Any], base_dir: str | Path = ".") -> OptimusConfig:
    """Build and validate a config from an in-memory mapping (tests, programmatic use)."""
    raw = _resolve_model_bases(dict(raw), Path(base_dir))
    config = calibrate(load_typed(OptimusConfig, raw, ""))
    validate(config)
    return config


def _read_yaml(path: Path, field_name: str) -> Any:
    try:
        return read_yaml_file(path)
    except FileNotFoundError:
        raise ConfigError(
            field_name, f"file {path} does not exist; pass an existing YAML file"
        ) from None
    except OSError as exc:
        raise ConfigError(field_name, f"cannot read {path}: {exc.strerror}") from None
    except YAMLInputError as exc:
        raise ConfigError(field_name, f"{path} {exc}") from None


def _resolve_model_bases(raw: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    model = raw.get("model")
    if not isinstance(model, dict):
        return raw
    model = dict(model)
    if isinstance(model.get("llm"), dict):
        model["llm"] = _merge_base(model["llm"], base_dir, "model.llm")
    if isinstance(model.get("encoders"), list):
        model["encoders"] = [
            _merge_base(enc, base_dir, f"model.encoders[{i}]") if isinstance(enc, dict) else enc
            for i, enc in enumerate(model["encoders"])
        ]
    raw = dict(raw)
    raw["model"] = model
    return raw


def _merge_base(section: dict[str, Any], base_dir: Path, where: str) -> dict[str, Any]:
    if "base" not in section:
        return section
    base_name = section["base"]
    if not isinstance(base_name, str):
        raise ConfigError(f"{where}.base", "must be a path to a YAML file, relative to this config")
    base = _read_yaml(base_dir / base_name, f"{where}.base")
    if not isinstance(base, dict):
        raise ConfigError(f"{where}.base", f"{base_name} must hold a mapping of model fields")
    merged = {**base, **{k: v for k, v in section.items() if k != "base"}}
    return merged


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(
            "--override", f"'{item}' is not key=value; write e.g. training.micro_batch_size=2"
        )
    key, value = item.split("=", 1)
    node: Any = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise ConfigError(
                ".".join(parts[: i + 1]), f"cannot override inside a {type(node).__name__}"
            )
    if not isinstance(node, dict):
        raise ConfigError(key, "override must name a mapping key")
    try:
        node[parts[-1]] = parse_yaml(value)
    except YAMLInputError as exc:
        raise ConfigError(
            key, f"the --override value {value[:40]!r} {exc}; write it as YAML, e.g. {key}=2"
        ) from None


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """A ``model`` section as written out (e.g. in a checkpoint's meta.json): fields it lacks, added
    to the schema since, take their defaults. ConfigError on keys or values this schema does not
    know."""
    return load_typed(ModelConfig, data, "model")


def calibrate(config: OptimusConfig) -> OptimusConfig:
    """``config`` under its ``cost_model.calibration``."""
    calibration = load_calibration(config.cost_model.calibration)
    if calibration is None:
        return config
    training = config.training
    if calibration.recompute is not None:
        training = dataclasses.replace(training, recompute=calibration.recompute)
    return dataclasses.replace(
        config,
        cost_model=dataclasses.replace(config.cost_model, **calibration.constants),
        training=training,
    )
