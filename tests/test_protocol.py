"""The wire codec and every message type: round trips and rejection of malformed frames."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from common.errors import ErrorCode, ProtocolError, RemoteError
from common.protocol.messages import (
    REPLIES,
    REQUESTS,
    DataReply,
    DataRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    PushRequest,
    StatusReply,
    StatusRequest,
    TaskReply,
    TaskRequest,
    error_frames,
    parse_message,
)
from common.protocol.wire import PROTOCOL_VERSION, decode_frames, encode_frames

STATE = np.arange(10, dtype=np.float32)

EXAMPLES = [
    JoinRequest(name="gpu-0", device="cuda:0", slowdown=1.0, threads=4),
    TaskRequest(worker_id=3, speed=812.5),
    PushRequest(
        worker_id=3,
        task_id=9,
        version=4,
        batch_size=12,
        speed=800.0,
        compute_s=0.02,
        loss=0.7,
        state=STATE,
    ),
    DataRequest(worker_id=3, indices=[5, 1, 99]),
    StatusRequest(),
    HeartbeatRequest(worker_id=3),
    LeaveRequest(worker_id=3, reason="done"),
    JoinReply(
        worker_id=3,
        mode="async",
        model="hsi-cnn",
        in_channels=198,
        num_classes=4,
        input_size=5,
        state_size=10,
        dataset_fingerprint="ab12",
        seed=0,
        server_id="5f3a",
        heartbeat_s=1.0,
        dead_after_s=5.0,
    ),
    TaskReply(
        action="train", task_id=9, version=4, epoch=1, indices=[1, 2], prefetch=[3], params=STATE
    ),
    DataReply(x=np.ones((2, 3, 5, 5), dtype=np.float32), y=np.array([0, 1], dtype=np.int64)),
    StatusReply(status={"mode": "async", "version": 4}),
    HeartbeatReply(server_id="5f3a"),
    LeaveReply(),
]


def _wire_bytes(frames: list) -> list[bytes]:
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.TYPE)
def test_every_message_round_trips(message) -> None:
    table = REQUESTS if message.TYPE in REQUESTS else REPLIES
    decoded, rid = parse_message(_wire_bytes(message.to_wire(41)), table)
    assert rid == 41
    assert type(decoded) is type(message)
    for name, value in vars(message).items():
        got = getattr(decoded, name)
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and got.shape == value.shape
            np.testing.assert_array_equal(got, value)
        else:
            assert got == value


def test_every_type_has_an_example() -> None:
    assert {m.TYPE for m in EXAMPLES} == set(REQUESTS) | set(REPLIES)


def test_error_reply_raises_remote_error_with_code() -> None:
    with pytest.raises(RemoteError) as info:
        parse_message(_wire_bytes(error_frames(7, ErrorCode.STALE, "too old")), REPLIES)
    assert info.value.code == ErrorCode.STALE and info.value.request_id == 7


def _header(**fields) -> bytes:
    base = {"v": PROTOCOL_VERSION, "type": "status_request", "id": 1, "body": {}, "tensors": []}
    base.update(fields)
    return msgpack.packb(base)


BAD = {
    "garbage": ([b"\xc1\xff\x00garbage"], ErrorCode.BAD_FRAME),
    "truncated msgpack": (
        [msgpack.packb({"v": 1, "type": "status_request"})[:-3]],
        ErrorCode.BAD_FRAME,
    ),
    "non-map header": ([msgpack.packb([1, 2, 3])], ErrorCode.BAD_FRAME),
    "unknown type": ([_header(type="rm_rf")], ErrorCode.UNKNOWN_TYPE),
    "wrong version": ([_header(v=99)], ErrorCode.BAD_VERSION),
    "missing version": ([msgpack.packb({"type": "status_request"})], ErrorCode.BAD_VERSION),
    "frame length mismatch": (
        [_header(type="push_request", tensors=[{"dtype": "float32", "shape": [4]}]), b"\x00" * 15],
        ErrorCode.BAD_TENSOR,
    ),
    "object dtype": (
        [_header(tensors=[{"dtype": "object", "shape": [1]}]), b"\x00" * 8],
        ErrorCode.BAD_TENSOR,
    ),
    "descriptor count": ([_header(tensors=[]), b"\x00" * 4], ErrorCode.BAD_TENSOR),
    "negative shape": (
        [_header(tensors=[{"dtype": "uint8", "shape": [-1]}]), b""],
        ErrorCode.BAD_TENSOR,
    ),
    "body not a map": ([_header(body=[1])], ErrorCode.BAD_FIELD),
    "unknown field": ([_header(body={"x": 1})], ErrorCode.BAD_FIELD),
    "wrong field type": (
        [_header(type="task_request", body={"worker_id": "1", "speed": 1.0})],
        ErrorCode.BAD_FIELD,
    ),
    "bool is not int": (
        [_header(type="task_request", body={"worker_id": True, "speed": 1.0})],
        ErrorCode.BAD_FIELD,
    ),
    "non-finite float": (
        [_header(type="task_request", body={"worker_id": 1, "speed": float("nan")})],
        ErrorCode.BAD_FIELD,
    ),
    "missing field": ([_header(type="task_request", body={"worker_id": 1})], ErrorCode.BAD_FIELD),
    "index list of strings": (
        [_header(type="data_request", body={"worker_id": 1, "indices": ["a"]})],
        ErrorCode.BAD_FIELD,
    ),
    "missing tensor": (
        [
            _header(
                type="push_request",
                body={
                    "worker_id": 1,
                    "task_id": 1,
                    "version": 0,
                    "batch_size": 1,
                    "speed": 1.0,
                    "compute_s": 0.1,
                    "loss": 0.1,
                },
            )
        ],
        ErrorCode.BAD_TENSOR,
    ),
    "empty": ([], ErrorCode.BAD_FRAME),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_frames_are_rejected_with_a_code(name: str) -> None:
    frames, code = BAD[name]
    with pytest.raises(ProtocolError) as info:
        parse_message(frames, REQUESTS)
    assert info.value.code == code, str(info.value)


def test_tensors_are_read_without_copy_and_big_endian_is_refused() -> None:
    array = np.arange(6, dtype=np.float64).reshape(2, 3)
    frames = encode_frames({"type": "x", "id": 1}, [array])
    header, tensors = decode_frames(frames)
    assert header["tensors"] == [{"dtype": "float64", "shape": [2, 3]}]
    np.testing.assert_array_equal(tensors[0], array)
    assert np.shares_memory(tensors[0], array)  # zero copy
    with pytest.raises(ProtocolError):
        encode_frames({}, [array.astype(">f8")])
    with pytest.raises(ProtocolError):
        encode_frames({}, [np.array(["a"], dtype=object)])
