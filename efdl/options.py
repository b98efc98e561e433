"""How a config dataclass is read: every field is one option, from four layers.

Precedence is flag > ``EFDL_<NAME>`` environment variable > YAML file > default. Every
field of a config dataclass (efdl.config) is one option: ``lease_ttl_s`` is ``--lease-ttl``
on the command line, ``EFDL_LEASE_TTL`` in the environment and ``lease_ttl`` (or
``lease-ttl``) in YAML. A unit suffix (``_s``) is part of the field name only.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from efdl.errors import ConfigError

C = TypeVar("C")

_UNIT_SUFFIXES = ("_s",)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def option_name(field_name: str, cls: type | None = None) -> str:
    """``lease_ttl_s`` -> ``lease_ttl``: the name users see (flag, env var, YAML key).

    A field may set ``metadata={"option": "min"}`` to be called something else.
    """
    if cls is not None:
        for f in dataclasses.fields(cls):
            if f.name == field_name and "option" in f.metadata:
                return str(f.metadata["option"])
    for suffix in _UNIT_SUFFIXES:
        if field_name.endswith(suffix):
            return field_name[: -len(suffix)]
    return field_name


def env_name(field_name: str, cls: type | None = None) -> str:
    return "EFDL_" + option_name(field_name, cls).upper()


def _convert(value: Any, annotation: Any, where: str) -> Any:
    """Coerce a raw value (a string from env, anything from YAML) to the field's type."""
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], where)
    if value is None:
        raise ConfigError(f"{where} must not be empty.")
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if annotation is Path:
            return Path(str(value)).expanduser()
        if annotation is str:
            if isinstance(value, dict | list):
                raise ValueError
            return str(value)
        if origin is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(i).strip() for i in items if str(i).strip())
    except (TypeError, ValueError):
        kind = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{where} is {value!r}; expected {_describe(kind)}.") from None
    return value


def _describe(kind: str) -> str:
    return {
        "bool": "true or false",
        "int": "a whole number",
        "float": "a number",
        "Path": "a file path",
        "str": "a string",
    }.get(kind, kind)


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping in a YAML config file.

    Raises:
        ConfigError: the file is missing, is not YAML, or is not a mapping.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"Cannot read the config file {str(path)!r}: {exc.strerror}.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(
            f"The config file {str(path)!r} is not valid YAML{where}: {problem}."
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"The config file {str(path)!r} must hold a mapping of option: value; "
            f"it holds a {type(data).__name__}."
        )
    return data


def load(
    cls: type[C],
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    yaml_data: Mapping[str, Any] | None = None,
    yaml_source: str = "the config file",
) -> C:
    """Build the config dataclass ``cls`` from flags > env > YAML > defaults.

    Args:
        flags: field name -> value given on the command line; None means not given.
        env: the environment (default: ``os.environ``).
        yaml_data: the mapping read from a YAML file, keys in option spelling.
        yaml_source: the file's name, for error messages.

    Raises:
        ConfigError: an unknown YAML key, or a value of the wrong type.
    """
    env = os.environ if env is None else env
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    by_option = {option_name(n, cls): n for n in fields}
    from_yaml: dict[str, tuple[str, Any]] = {}  # field -> (the key as written, value)
    for key, value in (yaml_data or {}).items():
        name = by_option.get(str(key).replace("-", "_"))
        if name is None:
            known = ", ".join(sorted(o.replace("_", "-") for o in by_option))
            raise ConfigError(f"Unknown key {key!r} in {yaml_source}; known keys: {known}.")
        from_yaml[name] = (str(key), value)
    values: dict[str, Any] = {}
    for name in fields:
        flag = flags.get(name)
        variable = env_name(name, cls)
        if flag is not None:
            values[name] = _convert(
                flag, hints[name], f"--{option_name(name, cls).replace('_', '-')}"
            )
        elif variable in env:
            values[name] = _convert(env[variable], hints[name], variable)
        elif name in from_yaml:
            key, value = from_yaml[name]
            values[name] = _convert(value, hints[name], f"{key!r} in {yaml_source}")
    config = cls(**values)
    # A config whose flags imply others (LaunchConfig: torchrun's) makes them explicit.
    resolved = getattr(config, "resolved", None)
    return resolved() if callable(resolved) else config
