"""Helpers shared by every component's validated config dataclass."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.errors import ConfigError


def need(ok: bool, message: str) -> None:
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
