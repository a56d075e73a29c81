"""Helpers shared by every component's validated config dataclass."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from common.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def name_problem(value: str, what: str) -> str:
    """Why ``value`` may not be a name that logs, run files and reports show (a worker's name
    or device), or "" when it may: 1 to 64 letters, digits or ``._:@+-``, the first a letter
    or digit."""
    if _NAME.fullmatch(value):
        return ""
    return f"{what} {value[:80]!r} must be 1-64 letters, digits or ._:@+- (first a letter or digit)"


def escape_control(text: str) -> str:
    """``text`` with every control character written as an escape (``\\n``), for one line."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def need(ok: object, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def default(cls: type, name: str) -> Any:
    """The default of field ``name`` of a config dataclass (what click options show).

    Raises:
        KeyError: no such field, or it has no default.
    """
    for field in dataclasses.fields(cls):
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                return field.default
            if field.default_factory is not dataclasses.MISSING:
                return field.default_factory()
    raise KeyError(name)


def flag(name: str) -> str:
    """The option of config field ``name``, without ``--``: ``shutdown_timeout_s`` is
    ``shutdown-timeout``."""
    return name.removesuffix("_s").replace("_", "-")
