"""The message machinery: frozen dataclasses with validated ``to_wire``/``from_parts``, parsing
and error replies. The message catalogue is in ``messages`` and ``shard_messages``."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
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
        own_init = "__init__" in vars(cls)  # kept by the dataclass in place of its own
        dataclasses.dataclass(frozen=True, kw_only=kw_only)(cls)
        if (
            own_init
            or hasattr(cls, "__post_init__")
            or not all(f.init for f in dataclasses.fields(cls))
        ):
            _BUILT_BY_INIT.add(cls)

    def to_wire(self, request_id: int) -> list[Any]:
        """Encode this message as frames tagged with ``request_id``."""
        body: dict[str, Any] = {}
        tensors: list[np.ndarray] = []
        for name, _, optional, kind, _ in _schema(type(self)):
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
        schema = _schema(cls)
        expected = _TENSORS[cls]
        if len(tensors) != expected:
            raise ProtocolError(
                ErrorCode.BAD_TENSOR, f"{cls.TYPE}: expects {expected} tensors, got {len(tensors)}"
            )
        values: dict[str, Any] = {}
        arrays = iter(tensors)
        given = 0  # header fields of the body that are fields of the message
        for name, base, optional, _, check in schema:
            if check is None:  # a tensor
                values[name] = next(arrays)
                continue
            value = body.get(name, _ABSENT)
            if value is _ABSENT:
                if not optional:
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"{cls.TYPE}: missing field {name!r}")
                value = None
            else:
                given += 1
            if value is None and optional:
                values[name] = None
                continue
            try:
                values[name] = check(value, base)
            except _BadValue as bad:
                raise ProtocolError(
                    ErrorCode.BAD_FIELD, f"{cls.TYPE}: field {name!r} {bad}"
                ) from None
        if given != len(body):  # a key that is no header field (a tensor's name included)
            extra = set(body).difference(name for name, *_, check in schema if check is not None)
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"{cls.TYPE}: unknown fields {sorted(extra)!r}"
            )
        if cls in _BUILT_BY_INIT:
            return cls(**values)
        message = object.__new__(cls)  # what __init__ does with every field given, faster
        message.__dict__.update(values)
        return message


Checker = Callable[[Any, Any], Any]
_SCHEMAS: dict[type, list[tuple[str, Any, bool, str, Checker | None]]] = {}
_TENSORS: dict[type, int] = {}  # tensor fields per class (filled in by ``_schema``)
_BUILT_BY_INIT: set[type] = set()  # classes whose __init__ does more than set the fields
_ABSENT = object()


def _schema(cls: type) -> list[tuple[str, Any, bool, str, Checker | None]]:
    """Per field: name, type (without None), whether it is optional (``X | None = None``: null
    or absent on the wire), the checked kind and its checker (None for a tensor), resolved once
    per class, so parsing a message does no ``typing`` introspection."""
    if cls not in _SCHEMAS:
        hints = typing.get_type_hints(cls)
        schema = []
        for field in dataclasses.fields(cls):
            base, optional, kind = _resolve(hints[field.name])
            check = None if kind == "tensor" else _CHECKS[kind]
            schema.append((field.name, base, optional, kind, check))
        _TENSORS[cls] = sum(kind == "tensor" for _, _, _, kind, _ in schema)
        _SCHEMAS[cls] = schema
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


class _BadValue(Exception):
    """A value does not match its field's annotation; the text says why."""


def _check_int(value: Any, base: Any) -> Any:
    if type(value) is not int:
        raise _BadValue(f"must be an int, got {value!r:.60}")
    return value


def _check_float(value: Any, base: Any) -> Any:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _BadValue(f"must be a finite number, got {value!r:.60}")
    return float(value)


def _check_str(value: Any, base: Any) -> Any:
    if type(value) is not str or len(value) > MAX_STRING:
        raise _BadValue(f"must be a string of at most {MAX_STRING} characters")
    return value


def _check_enum(value: Any, base: Any) -> Any:
    """The enum ``base`` member of a string value."""
    try:
        return base(_check_str(value, base))
    except ValueError:
        raise _BadValue("unknown value") from None


def _check_bool(value: Any, base: Any) -> Any:
    if type(value) is not bool:
        raise _BadValue(f"must be a bool, got {value!r:.60}")
    return value


def _check_ints(value: Any, base: Any) -> Any:
    if type(value) is not list or len(value) > MAX_INDICES:
        raise _BadValue(f"must be a list of at most {MAX_INDICES} ints")
    if not _only(value, int):
        raise _BadValue("must contain only ints")
    return value


def _check_floats(value: Any, base: Any) -> Any:
    if type(value) is not list or len(value) > MAX_LIST:
        raise _BadValue(f"must be a list of at most {MAX_LIST} numbers")
    if not (_only(value, int, float) and all(map(math.isfinite, value))):
        raise _BadValue("must contain only finite numbers")
    return [float(v) for v in value]


def _check_strs(value: Any, base: Any) -> Any:
    if type(value) is not list or len(value) > MAX_LIST:
        raise _BadValue(f"must be a list of at most {MAX_LIST} strings")
    if not (_only(value, str) and all(len(v) <= MAX_STRING for v in value)):
        raise _BadValue(f"must contain only strings of at most {MAX_STRING} characters")
    return value


def _check_dict(value: Any, base: Any) -> Any:
    if type(value) is not dict:
        raise _BadValue("must be a map")
    return value


# Per kind, the check of a value that is not an optional field's None: the value as the
# message holds it (an enum's value as the enum), or ``_BadValue``.
_CHECKS: dict[str, Checker] = {
    "int": _check_int,
    "float": _check_float,
    "str": _check_str,
    "enum": _check_enum,
    "bool": _check_bool,
    "list[int]": _check_ints,
    "list[float]": _check_floats,
    "list[str]": _check_strs,
    "dict": _check_dict,
}


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
