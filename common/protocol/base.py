"""The message machinery: frozen dataclasses with validated ``to_wire``/``from_parts``, parsing
and error replies. The message catalogue is in ``messages`` and ``shard_messages``."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from common.errors import ErrorCode, ProtocolError, RemoteError
from common.protocol.wire import decode_frames, encode_frames

MAX_INDICES = 1 << 17
MAX_STRING = 4096
MAX_LIST = 1024


@typing.dataclass_transform(frozen_default=True)
@dataclasses.dataclass(frozen=True)
class Message:
    """Base of every message: each subclass is a frozen dataclass (``kw_only`` may be given as a
    class keyword) whose fields are header entries, ``np.ndarray`` fields frames; its wire
    ``TYPE`` is the class name in snake case (``PushRequest``: ``push_request``)."""

    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, kw_only: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TYPE = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
        dataclasses.dataclass(frozen=True, kw_only=kw_only)(cls)

    def to_wire(self, request_id: int) -> list[Any]:
        """Encode this message as frames tagged with ``request_id``."""
        body: dict[str, Any] = {}
        tensors: list[np.ndarray] = []
        for name, _, optional, kind in _schema(type(self)):
            value = getattr(self, name)
            if kind == "tensor":
                tensors.append(value)
            elif value is not None or not optional:  # an unset optional one stays off
                body[name] = value.value if kind == "enum" and value is not None else value
        return encode_frames(
            {"type": self.TYPE, "id": request_id, "status": "ok", "body": body}, tensors
        )

    @classmethod
    def from_parts(cls, body: Any, tensors: list[np.ndarray]) -> Message:
        """Build and validate a message from a decoded header body and its tensors.

        Raises:
            ProtocolError: a field is missing, of the wrong type or out of range.
        """
        if not isinstance(body, dict):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{cls.TYPE}: body must be a map")
        values: dict[str, Any] = {}
        schema = _schema(cls)
        tensor_fields = [n for n, _, _, k in schema if k == "tensor"]
        if len(tensors) != len(tensor_fields):
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"{cls.TYPE}: expects {len(tensor_fields)} tensors, got {len(tensors)}",
            )
        arrays = iter(tensors)
        for name, base, optional, kind in schema:
            if kind == "tensor":
                values[name] = next(arrays)
                continue
            if name not in body and not optional:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"{cls.TYPE}: missing field {name!r}")
            values[name] = _check(cls.TYPE, name, optional, kind, base, body.get(name))
        extra = set(body) - set(values)
        if extra:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"{cls.TYPE}: unknown fields {sorted(extra)!r}"
            )
        return cls(**values)


_SCHEMAS: dict[type, list[tuple[str, Any, bool, str]]] = {}


def _schema(cls: type) -> list[tuple[str, Any, bool, str]]:
    """Per field: name, type (without None), whether it is optional (``X | None = None``: null
    or absent on the wire) and the checked kind (resolved once per class, so parsing a message
    does no ``typing`` introspection)."""
    if cls not in _SCHEMAS:
        hints = typing.get_type_hints(cls)
        _SCHEMAS[cls] = [(f.name, *_resolve(hints[f.name])) for f in dataclasses.fields(cls)]
    return _SCHEMAS[cls]


def _resolve(kind: Any) -> tuple[Any, bool, str]:
    """``(type without None, optional, kind name)`` of a field annotation."""
    optional = False
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        options = typing.get_args(kind)
        optional = type(None) in options
        kind = next(k for k in options if k is not type(None))
    if kind is np.ndarray:
        return kind, optional, "tensor"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind, optional, "enum"  # sent as its value, a string
    for simple in (bool, int, float, str, dict):
        if kind is simple:
            return kind, optional, simple.__name__
    if typing.get_origin(kind) is list and typing.get_args(kind) in ((int,), (float,), (str,)):
        return kind, optional, f"list[{typing.get_args(kind)[0].__name__}]"
    raise TypeError(f"unsupported field annotation {kind!r}")  # a bug in a message class


def _check(mtype: str, name: str, optional: bool, kind: str, base: Any, value: Any) -> Any:
    """Return ``value`` if it matches the resolved annotation (an enum's value as the enum
    ``base``), else raise BAD_FIELD."""

    def bad(why: str) -> ProtocolError:
        return ProtocolError(ErrorCode.BAD_FIELD, f"{mtype}: field {name!r} {why}")

    if value is None and optional:
        return None
    if kind == "int":
        if type(value) is not int:
            raise bad(f"must be an int, got {value!r:.60}")
        return value
    if kind == "float":
        if type(value) not in (int, float) or not math.isfinite(value):
            raise bad(f"must be a finite number, got {value!r:.60}")
        return float(value)
    if kind in ("str", "enum"):
        if type(value) is not str or len(value) > MAX_STRING:
            raise bad(f"must be a string of at most {MAX_STRING} characters")
        if kind == "str":
            return value
        try:
            return base(value)
        except ValueError:
            raise bad("unknown value") from None
    if kind == "bool":
        if type(value) is not bool:
            raise bad(f"must be a bool, got {value!r:.60}")
        return value
    if kind == "list[int]":
        if type(value) is not list or len(value) > MAX_INDICES:
            raise bad(f"must be a list of at most {MAX_INDICES} ints")
        if not _only(value, int):
            raise bad("must contain only ints")
        return value
    if kind == "list[float]":
        if type(value) is not list or len(value) > MAX_LIST:
            raise bad(f"must be a list of at most {MAX_LIST} numbers")
        if not (_only(value, int, float) and all(map(math.isfinite, value))):
            raise bad("must contain only finite numbers")
        return [float(v) for v in value]
    if kind == "list[str]":
        if type(value) is not list or len(value) > MAX_LIST:
            raise bad(f"must be a list of at most {MAX_LIST} strings")
        if not (_only(value, str) and all(len(v) <= MAX_STRING for v in value)):
            raise bad(f"must contain only strings of at most {MAX_STRING} characters")
        return value
    if type(value) is not dict:  # kind == "dict"
        raise bad("must be a map")
    return value


def _only(values: list[Any], *kinds: type) -> bool:
    """Whether every value's type is one of ``kinds`` exactly (a bool is not an int here)."""
    return set(map(type, values)).issubset(kinds)


def by_type(*classes: type[Message]) -> dict[str, type[Message]]:
    """A table for ``parse_message``: each message class under its wire type."""
    return {m.TYPE: m for m in classes}


def parse_message(frames: Sequence[Any], table: dict[str, type[Message]]) -> tuple[Message, int]:
    """Decode frames into one of the messages in ``table``.

    Returns:
        The message and its request id (0 when the header has none usable).

    Raises:
        ProtocolError: malformed frames, wrong version, unknown type or invalid fields.
        RemoteError: the frames are an error reply.
    """
    header, tensors = decode_frames(frames)
    rid = header.get("id")
    rid = rid if type(rid) is int and 0 <= rid < 1 << 63 else 0
    if header.get("status") == "error":
        error = RemoteError(header.get("code", ErrorCode.INTERNAL), str(header.get("message")))
        error.request_id = rid
        raise error
    mtype = header.get("type")
    cls = table.get(mtype) if isinstance(mtype, str) else None
    try:
        if cls is None:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {mtype!r:.60}")
        return cls.from_parts(header.get("body", {}), tensors), rid
    except ProtocolError as exc:
        exc.request_id = rid
        raise


def error_frames(request_id: int, code: ErrorCode, message: str) -> list[Any]:
    """Frames of an error reply."""
    return encode_frames(
        {
            "type": "error",
            "id": request_id,
            "status": "error",
            "code": int(code),
            "message": message[:MAX_STRING],
        }
    )
