"""Configuration: one frozen object per command, validated once, from four layers.

Precedence is flag > ``EFDL_<NAME>`` environment variable > YAML file > default. Every
field of a config dataclass is one option: ``lease_ttl_s`` is ``--lease-ttl`` on the command
line, ``EFDL_LEASE_TTL`` in the environment and ``lease_ttl`` (or ``lease-ttl``) in YAML.
A unit suffix (``_s``) is part of the field name only.
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
from efdl.rendezvous.api import EtcdSettings

C = TypeVar("C")

PASSWORD_ENV = "EFDL_ETCD_PASSWORD"
_UNIT_SUFFIXES = ("_s",)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def option_name(field_name: str) -> str:
    """``lease_ttl_s`` -> ``lease_ttl``: the name users see (flag, env var, YAML key)."""
    for suffix in _UNIT_SUFFIXES:
        if field_name.endswith(suffix):
            return field_name[: -len(suffix)]
    return field_name


def env_name(field_name: str) -> str:
    return "EFDL_" + option_name(field_name).upper()


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
    by_option = {option_name(n): n for n in fields}
    from_yaml: dict[str, Any] = {}
    for key, value in (yaml_data or {}).items():
        name = by_option.get(str(key).replace("-", "_"))
        if name is None:
            known = ", ".join(sorted(o.replace("_", "-") for o in by_option))
            raise ConfigError(f"Unknown key {key!r} in {yaml_source}; known keys: {known}.")
        from_yaml[name] = value
    values: dict[str, Any] = {}
    for name in fields:
        flag = flags.get(name)
        if flag is not None:
            values[name] = _convert(flag, hints[name], f"--{option_name(name).replace('_', '-')}")
        elif env_name(name) in env:
            values[name] = _convert(env[env_name(name)], hints[name], env_name(name))
        elif name in from_yaml:
            values[name] = _convert(
                from_yaml[name], hints[name], f"{option_name(name)!r} in {yaml_source}"
            )
    return cls(**values)


def read_password(password_file: Path | None, env: Mapping[str, str] | None = None) -> str | None:
    """The etcd password: from the file if given, else ``EFDL_ETCD_PASSWORD``, else None.

    Never from a command-line argument, where ``ps`` would show it.
    """
    env = os.environ if env is None else env
    if password_file is not None:
        try:
            return password_file.read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(
                f"Cannot read the etcd password file {str(password_file)!r}: {exc.strerror}."
            ) from None
    return env.get(PASSWORD_ENV)


@dataclasses.dataclass(frozen=True, slots=True)
class EtcdClientConfig:
    """How a command reaches etcd (``--etcd``, ``--etcd-ca`` ... in every command).

    Attributes:
        etcd: comma-separated endpoints, e.g. ``etcd-1:2379,etcd-2:2379``.
        etcd_ca: CA bundle that signed the etcd servers' certificates (turns on TLS).
        etcd_cert: client certificate, for etcd's ``--client-cert-auth``.
        etcd_key: the client certificate's key.
        etcd_user: user for etcd's auth; the password comes from ``EFDL_ETCD_PASSWORD`` or
            ``etcd_password_file``, never from a flag.
        etcd_password_file: file holding the password (one line).
        etcd_timeout_s: bound on each etcd request, failover included; also how long to
            keep trying to connect at start.
    """

    etcd: str | None = None
    etcd_ca: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    etcd_user: str | None = None
    etcd_password_file: Path | None = None
    etcd_timeout_s: float = 5.0

    def etcd_settings(
        self, endpoints: str | None = None, env: Mapping[str, str] | None = None
    ) -> EtcdSettings:
        """Resolved client settings (reads the password); ``endpoints`` overrides ``etcd``."""
        target = endpoints or self.etcd
        if not target:
            raise ConfigError(
                "No etcd endpoints were given: pass --etcd host:port[,host:port...] "
                "(or EFDL_ETCD), or use --standalone."
            )
        password = read_password(self.etcd_password_file, env)
        if password is not None and self.etcd_user is None:
            password = None  # a password in the environment alone does not turn auth on
        return EtcdSettings.from_list(
            target,
            ca_file=self.etcd_ca,
            cert_file=self.etcd_cert,
            key_file=self.etcd_key,
            user=self.etcd_user,
            password=password,
            request_timeout_s=self.etcd_timeout_s,
            connect_timeout_s=max(self.etcd_timeout_s, 2 * self.etcd_timeout_s),
        )
