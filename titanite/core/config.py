"""The run configuration: defaults, then a TOML file, then `--section.key=value` overrides.

TOML files and overrides only fill in the dataclasses of config_schema.py, which this module
re-exports: the rest of titanite imports them from here. Validation happens before any work:
a bad key or type here, a bad value in config_checks.py; each raises `UserError` naming the key.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from titanite.core.config_checks import validate
from titanite.core.config_schema import (
    DEFAULT_SHARD_MB,
    LORA_ALL,
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    TRACKERS,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    JobConfig,
    KernelsConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    ParallelismConfig,
    PreferenceConfig,
    TrainingConfig,
    coerce,
)
from titanite.core.errors import UserError, did_you_mean

__all__ = ["DEFAULT_SHARD_MB", "LORA_ALL", "CheckpointConfig", "Config", "DataConfig", "EvalConfig", "JobConfig",
           "KernelsConfig", "LoraConfig", "MetricsConfig", "ModelConfig", "PREFERENCE_LOSSES",
           "REFERENCE_FREE_LOSSES", "ParallelismConfig", "PreferenceConfig", "TRACKERS", "TrainingConfig",
           "help_text", "load_config", "to_dict", "to_toml"]


# Tables whose unknown keys are collected into a dict field instead of being rejected.
_OPEN_TABLES = {"kernels": "select"}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _set(cfg: Config, section: str, key: str, value: Any) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        raise UserError(f"unknown config section '[{section}]'{did_you_mean(section, sections)}; "
                        f"sections are: {', '.join(sections)}")
    obj = getattr(cfg, section)
    types_ = _field_types(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    if key not in names or (section in _OPEN_TABLES and key == _OPEN_TABLES[section]):
        if section in _OPEN_TABLES:
            if not isinstance(value, str):
                raise UserError(f"config key '{section}.{key}': expected an implementation name (string), got {value!r}")
            getattr(obj, _OPEN_TABLES[section])[key] = value
            return
        raise UserError(f"unknown config key '{section}.{key}'{did_you_mean(key, names)}")
    setattr(obj, key, coerce(f"{section}.{key}", value, types_[key]))


def _parse_override_value(raw: str) -> Any:
    """CLI values: TOML literals when they parse (numbers, bools, lists, quoted strings), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then `--section.key=value` overrides; validated."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"config file {p} is not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise UserError(f"config file {p}: '{section}' must be a table like [{section}]")
            for key, value in table.items():
                _set(cfg, section, key, value)
    for item in overrides or []:
        if not item.startswith("--") or "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"bad override '{item}': expected --section.key=value")
        dotted, raw = item[2:].split("=", 1)
        section, key = dotted.split(".", 1)
        key = key.strip('"')
        _set(cfg, section, key, _parse_override_value(raw))
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as nested plain dicts; the [kernels] select dict is flattened into its table."""
    out = dataclasses.asdict(cfg)
    for section, key in _OPEN_TABLES.items():
        out[section].update(out[section].pop(key))
    return out


def to_toml(cfg: Config) -> str:
    import tomli_w

    return tomli_w.dumps(to_dict(cfg))


def help_text() -> str:
    """Every key with its type, default and help string, for `titanite train --help-config`."""
    lines = []
    for section in dataclasses.fields(Config):
        lines.append(f"[{section.name}]")
        cls = section.default_factory  # type: ignore[misc]
        hints = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            typ = hints[f.name]
            tname = typ.__name__ if isinstance(typ, type) and not isinstance(typ, types.GenericAlias) else str(typ)
            lines.append(f"  {f.name} ({tname}, default {default!r}): {f.metadata.get('help', '')}")
        lines.append("")
    return "\n".join(lines)
