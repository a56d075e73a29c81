"""The wire codec and every message type: round trips and rejection of malformed frames."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from common.errors import ErrorCode, ProtocolError, RemoteError
from common.protocol import chunks
from common.protocol.base import Message, error_frames
from common.protocol.chunks import (
    ALIGN,
    as_tensor,
    chunk_spans,
    decode_into,
    encode,
    shard_bounds,
)
from common.protocol.ending import FinishReason
from common.protocol.messages import (
    REPLIES,
    STORE_REQUESTS,
    WORKER_REQUESTS,
    DataReply,
    DataRequest,
    GradientChunk,
    GradientPushRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveReply,
    LeaveRequest,
    ParamsChunk,
    PullRequest,
    PushRequest,
    StatusReply,
    StatusRequest,
    TaskParamsReply,
    TaskReply,
    TaskRequest,
    parse_message,
)
from common.protocol.shard_messages import (
    CONTROL_REPLIES,
    CONTROL_REQUESTS,
    AbortRequest,
    AckReply,
    CaptureRequest,
    DropRequest,
    PingReply,
    PingRequest,
    PrepareReply,
    PrepareRequest,
    PublishRequest,
    ShardHello,
    ShardWelcome,
    ShutdownRequest,
    StagedReply,
    StagedRequest,
    StateReply,
)
from common.protocol.wire import (
    PROTOCOL_VERSION,
    BFloat16Array,
    bfloat16_words,
    decode_frames,
    encode_frames,
)

STATE = np.arange(10, dtype=np.float32)
TOKEN = "0123456789abcdef0123456789abcdef"
PUSH = PushRequest(
    worker_id=3,
    token=TOKEN,
    task_id=9,
    version=4,
    batch_size=12,
    speed=800.0,
    compute_s=0.02,
    transfer_s=0.01,
    loss=0.7,
)

EXAMPLES = [
    JoinRequest(name="gpu-0", device="cuda:0", slowdown=1.0, threads=4),
    TaskRequest(worker_id=3, token=TOKEN, speed=812.5),
    PUSH,
    GradientPushRequest(**vars(PUSH), push_token=TOKEN, scale=1.0, gradient=STATE),
    GradientChunk(
        worker_id=3, token=TOKEN, task_id=9, version=4, offset=0, scale=1.0, gradient=STATE
    ),
    PullRequest(worker_id=3, token=TOKEN, min_version=4, offset=0, length=10),
    DataRequest(worker_id=3, token=TOKEN, indices=[5, 1, 99]),
    StatusRequest(),
    HeartbeatRequest(worker_id=3, token=TOKEN),
    LeaveRequest(worker_id=3, token=TOKEN, reason="done"),
    JoinReply(
        worker_id=3,
        token=TOKEN,
        store_token=TOKEN,
        mode="async",
        model="hsi-cnn",
        in_channels=198,
        num_classes=4,
        input_size=5,
        state_size=10,
        num_params=8,
        dataset_fingerprint="ab12",
        seed=0,
        server_id="5f3a",
        heartbeat_s=1.0,
        dead_after_s=5.0,
        wire_dtype="bf16",
        chunk_elems=1 << 20,
        shard_addresses=["", "tcp://10.0.0.2:7000"],
        shard_bounds=[0, 4, 10],
        sample_dtype="uint16",
        norm_mean=[1.5] * 198,
        norm_std=[2.0] * 198,
    ),
    TaskReply(
        action="train",
        task_id=9,
        push_token=TOKEN,
        version=4,
        epoch=1,
        indices=[1, 2],
        prefetch=[3],
    ),
    TaskParamsReply(
        action="train",
        task_id=9,
        push_token=TOKEN,
        version=5,
        epoch=1,
        indices=[1, 2],
        prefetch=[],
        params_version=5,
        scale=1.0,
        params=STATE,
    ),
    ParamsChunk(
        version=5, offset=0, scale=1.0, params=bfloat16_words(np.arange(10, dtype=np.uint16))
    ),
    DataReply(x=np.ones((2, 3, 5, 5), dtype=np.float32), y=np.array([0, 1], dtype=np.int64)),
    StatusReply(status={"mode": "async", "version": 4}),
    HeartbeatReply(server_id="5f3a", finish_reason=FinishReason.EPOCHS),
    LeaveReply(),
    ShardHello(address="tcp://10.0.0.2:7000", name="node-2", proof="ab" * 32),
    ShardWelcome(
        index=1,
        key=TOKEN,
        store_token_key=TOKEN,
        lo=4,
        hi=10,
        num_params=8,
        wire_dtype="fp32",
        chunk_elems=1024,
        optimizer="sgd",
        lr=0.1,
        momentum=0.9,
        nesterov=False,
        weight_decay=0.0,
        version=0,
        optimizer_steps=0,
        dead_after_s=60.0,
        nonneg_bounds=[8, 10],
        slots=["momentum"],
        state=STATE[4:],
        slot_state=STATE[4:8],
    ),
    StagedRequest(key=TOKEN, task_id=9, worker_id=3, timeout_s=5.0),
    StagedReply(finite=True, grad_sq=2.5, buffer_sq=0.0),
    PrepareRequest(
        key=TOKEN, version=5, task_ids=[9, 11], weights=[0.75, 0.25], lr_scale=1.0, buffer_scale=1.0
    ),
    PrepareReply(ok=False, reason="non-finite"),
    PublishRequest(key=TOKEN, version=5),
    AbortRequest(key=TOKEN, version=5, code=13, message="refused"),
    DropRequest(key=TOKEN, task_ids=[9], code=8, message="stale"),
    CaptureRequest(key=TOKEN, with_slots=True),
    StateReply(version=5, optimizer_steps=5, slots=["momentum"], state=STATE, slot_state=STATE),
    PingRequest(key=TOKEN),
    PingReply(version=5, staged=1),
    ShutdownRequest(key=TOKEN, reason="done"),
    AckReply(),
]
REQUESTS = {**WORKER_REQUESTS, **STORE_REQUESTS, **CONTROL_REQUESTS, ShardHello.TYPE: ShardHello}
ALL_REPLIES = {**REPLIES, **CONTROL_REPLIES}


def _wire_bytes(frames: list) -> list[bytes]:
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.TYPE)
def test_every_message_round_trips(message) -> None:
    table = REQUESTS if message.TYPE in REQUESTS else ALL_REPLIES
    decoded, rid = parse_message(_wire_bytes(message.to_wire(41)), table)
    assert rid == 41
    assert type(decoded) is type(message)
    assert list(vars(decoded)) == list(vars(message))  # every field, as __init__ sets them
    for name, value in vars(message).items():
        got = getattr(decoded, name)
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and got.shape == value.shape
            assert isinstance(got, BFloat16Array) == isinstance(value, BFloat16Array)
            np.testing.assert_array_equal(got, value)
        else:
            assert got == value


def test_every_type_has_an_example() -> None:
    assert {m.TYPE for m in EXAMPLES} == set(REQUESTS) | set(ALL_REPLIES)


def test_wire_type_names_are_the_documented_ones() -> None:
    """A message's wire type comes from its class name: these are the names peers send."""
    names = {
        "join_request",
        "task_request",
        "push_request",
        "gradient_push_request",
        "data_request",
        "heartbeat_request",
        "status_request",
        "leave_request",
        "gradient_chunk",
        "pull_request",
        "join_reply",
        "task_reply",
        "task_params_reply",
        "params_chunk",
        "data_reply",
        "status_reply",
        "heartbeat_reply",
        "leave_reply",
        "shard_hello",
        "shard_welcome",
        "staged_request",
        "staged_reply",
        "prepare_request",
        "prepare_reply",
        "publish_request",
        "abort_request",
        "drop_request",
        "capture_request",
        "state_reply",
        "ping_request",
        "ping_reply",
        "shutdown_request",
        "ack_reply",
    }
    assert sorted(m.TYPE for m in EXAMPLES) == sorted(names)
    assert REQUESTS.keys() | ALL_REPLIES.keys() == names


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
        [_header(type="task_request", body={"worker_id": "1", "token": "", "speed": 1.0})],
        ErrorCode.BAD_FIELD,
    ),
    "bool is not int": (
        [_header(type="task_request", body={"worker_id": True, "token": "", "speed": 1.0})],
        ErrorCode.BAD_FIELD,
    ),
    "non-finite float": (
        [_header(type="task_request", body={"worker_id": 1, "token": "", "speed": float("nan")})],
        ErrorCode.BAD_FIELD,
    ),
    "missing field": ([_header(type="task_request", body={"worker_id": 1})], ErrorCode.BAD_FIELD),
    "index list of strings": (
        [_header(type="data_request", body={"worker_id": 1, "token": "", "indices": ["a"]})],
        ErrorCode.BAD_FIELD,
    ),
    "weights with NaN": (
        [
            _header(
                type="prepare_request",
                body={
                    "key": "",
                    "version": 1,
                    "task_ids": [1],
                    "weights": [float("nan")],
                    "lr_scale": 1.0,
                    "buffer_scale": 1.0,
                },
            )
        ],
        ErrorCode.BAD_FIELD,
    ),
    "missing tensor": (
        [
            _header(
                type="gradient_chunk",
                body={
                    "worker_id": 1,
                    "token": "",
                    "task_id": 1,
                    "version": 0,
                    "offset": 0,
                    "scale": 1.0,
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


def test_optional_fields_may_be_null_or_absent_and_enums_take_only_their_values() -> None:
    def heartbeat(**body):
        frames = [_header(type="heartbeat_reply", body={"server_id": "s", **body})]
        return parse_message(frames, ALL_REPLIES)[0]

    assert heartbeat() == heartbeat(failure=None, finish_reason=None) == HeartbeatReply("s")
    assert heartbeat(finish_reason="epochs").finish_reason is FinishReason.EPOCHS
    with pytest.raises(ProtocolError, match="heartbeat_reply: field 'finish_reason' unknown value"):
        heartbeat(finish_reason="nope")
    with pytest.raises(ProtocolError, match="heartbeat_reply: field 'failure' must be a string"):
        heartbeat(failure=3)


class _Labelled(Message):
    """A message whose ``__post_init__`` fills in a field left out."""

    count: int
    label: str | None = None

    def __post_init__(self) -> None:
        if self.label is None:
            object.__setattr__(self, "label", f"#{self.count}")


class _Doubled(Message):
    """A message with an ``__init__`` of its own."""

    count: int

    def __init__(self, count: int) -> None:
        object.__setattr__(self, "count", 2 * count)


def test_a_message_whose_init_does_more_than_set_its_fields_is_parsed_through_it() -> None:
    assert _Labelled.from_parts({"count": 3}, []) == _Labelled(3) == _Labelled(3, "#3")
    assert _Labelled.from_parts({"count": 3, "label": "x"}, []).label == "x"
    doubled = _Doubled.from_parts({"count": 3}, [])
    assert doubled == _Doubled(3) and doubled.count == 6


def test_an_unknown_field_is_refused_when_an_optional_one_is_absent() -> None:
    """An unknown key in place of an absent optional field: as many keys as fields, and one
    of them is no field."""
    fields = {"server_id": "s", "failure": None, "finish_reason": None}
    for absent in ("failure", "finish_reason"):
        body = {k: v for k, v in fields.items() if k != absent} | {"shutdown": True}
        assert len(body) == len(fields)
        frames = [_header(type="heartbeat_reply", body=body)]
        with pytest.raises(ProtocolError, match=r"unknown fields \['shutdown'\]") as info:
            parse_message(frames, ALL_REPLIES)
        assert info.value.code == ErrorCode.BAD_FIELD


def test_a_body_key_that_names_a_tensor_field_is_refused() -> None:
    """Tensors come only as frames: a header key of a tensor's name is an unknown field."""
    x, y = np.ones((2, 3, 5, 5), dtype=np.float32), np.array([0, 1], dtype=np.int64)
    parsed = DataReply.from_parts({}, [x, y])
    assert isinstance(parsed, DataReply) and parsed.x is x and parsed.y is y
    with pytest.raises(ProtocolError, match=r"unknown fields \['y'\]") as info:
        DataReply.from_parts({"y": [0, 1]}, [x, y])
    assert info.value.code == ErrorCode.BAD_FIELD


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


THREAD_WAIT_S = 10.0
PROCESS_TIMEOUT_S = 60.0
CONVERT_READ_ONLY_FRAMES = """
import numpy as np
from common.protocol.chunks import as_tensor
from common.protocol.wire import decode_frames, encode_frames

frames = [bytes(f) for f in encode_frames({"type": "x", "id": 1}, [np.ones(8, np.float32)])]
for _ in range(3):
    _, (received,) = decode_frames(frames)
    assert not received.flags.writeable
    assert as_tensor(received, "fp32", "x").tolist() == [1.0] * 8
print("converted")
"""


def test_read_only_frames_become_tensors_without_a_warning() -> None:
    """torch warns once per process that a read-only array is not writable: in a fresh
    process, where that warning is still to come, with user warnings as errors, no conversion
    of a received frame lets it out, the first or a later one."""
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", CONVERT_READ_ONLY_FRAMES],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0 and done.stdout == "converted\n", done.stderr[-2000:]


def test_two_threads_converting_read_only_frames_leave_the_warning_filters_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first thread's conversion waits (up to a timeout) for the second thread's to begin,
    and the second's for the first thread to finish: unless the watches take turns, the
    second ends last and puts back the filters it found, the first's."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    convert, converted = torch.from_numpy, []

    def converting(array: np.ndarray) -> torch.Tensor:
        if threading.current_thread().name == "first":
            first_in.set()
            second_in.wait(0.5)
        else:
            second_in.set()
            first_out.wait(THREAD_WAIT_S)
        warnings.warn("not writable", UserWarning, stacklevel=1)  # as torch's first time
        return convert(array)

    def run(name: str) -> None:
        if name == "second":
            first_in.wait(THREAD_WAIT_S)
        converted.append(as_tensor(received, "fp32", "x").tolist())
        if name == "first":
            first_out.set()

    frames = [bytes(f) for f in encode_frames({"type": "x", "id": 1}, [np.ones(8, np.float32)])]
    _, (received,) = decode_frames(frames)
    monkeypatch.setattr(torch, "from_numpy", converting)
    monkeypatch.setattr(chunks._ReadOnlyWarning, "possible", True)
    filters = list(warnings.filters)
    threads = [threading.Thread(target=run, args=(n,), name=n) for n in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_WAIT_S)
    assert converted == [[1.0] * 8] * 2 and second_in.is_set()
    assert warnings.filters == filters


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
def test_wire_formats_round_trip_within_their_precision(wire: str) -> None:
    rng = np.random.default_rng(0)
    values = torch.from_numpy(rng.normal(0, 1e-3, 5000).astype(np.float32))
    values[0] = 0.0
    data, scale = encode(values, wire)
    frames = encode_frames({"type": "x", "id": 1}, [data])
    _, (received,) = decode_frames([bytes(f) for f in frames])
    out = torch.empty(5000)
    decode_into(as_tensor(received, wire, "x"), scale, out)
    tolerance = {"fp32": 0.0, "bf16": 2**-8, "fp16": 2**-10}[wire]
    torch.testing.assert_close(out, values, rtol=tolerance, atol=1e-12)
    if wire == "fp16":  # tiny gradients survive thanks to the scale
        assert scale > 1 and bool((out[1:] != 0).all())
    with pytest.raises(ProtocolError):  # the wrong format is refused
        as_tensor(received, "fp32" if wire != "fp32" else "bf16", "x")


def test_shard_bounds_and_chunks_are_aligned_and_cover_the_state() -> None:
    for size, shards in ((10, 1), (5000, 2), (1_000_003, 3), (2048, 4)):
        bounds = shard_bounds(size, shards)
        assert bounds[0] == 0 and bounds[-1] == size and bounds == sorted(bounds)
        assert all(b % ALIGN == 0 for b in bounds[1:-1])
        for lo, hi in itertools.pairwise(bounds):
            spans = chunk_spans(lo, hi, 3000)
            assert [a for a, _ in spans] == [lo, *(b for _, b in spans[:-1])] or lo == hi
            assert all(a % ALIGN == 0 for a, _ in spans)
    sizes = np.diff(shard_bounds(1_000_003, 3))
    assert sizes.max() - sizes.min() <= ALIGN  # even in bytes
