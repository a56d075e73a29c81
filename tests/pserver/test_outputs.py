"""Jasper Ridge: train, export, load without the project, predict the map, per-class results."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.io
import torch
from click.testing import CliRunner

from common.data.dataset import DatasetReader
from pserver.cli import main
from tests.support.cli import one_line_error

PATCH = 5


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(main, args)


# --- model files from someone else -----------------------------------------------------------

EVIL_MODULE = """\
from pathlib import Path

Path(__file__).with_name("IMPORTED").touch()


def build(in_channels, num_classes, input_size):
    from common.training.models import hsi_cnn

    return hsi_cnn(in_channels, num_classes, input_size)
"""


def _program_file(path: Path, model: str = "hsi-cnn") -> Path:
    """A program file as 'pserver export' writes it (an untrained hsi-cnn on 4-band 5x5
    patches), its metadata naming ``model``."""
    from common.training.models import hsi_cnn
    from pserver.outputs.export import MAGIC, RawInput, quiet_torch

    meta = {
        "format": MAGIC,
        "export": "program",
        "model": model,
        "kind": "hsi",
        "bands": 4,
        "height": PATCH,
        "width": PATCH,
        "patch": PATCH,
        "class_names": ["a", "b", "c"],
        "num_classes": 3,
        "norm_mean": [0.5] * 4,
        "norm_std": [2.0] * 4,
    }
    torch.manual_seed(0)
    module = RawInput(hsi_cnn(4, 3, PATCH), np.full(4, 0.5), std=np.full(4, 2.0)).eval()
    example = torch.zeros((2, 4, PATCH, PATCH))
    with quiet_torch(), torch.no_grad():
        program = torch.export.export(
            module, (example,), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},)
        )
        with path.open("wb") as handle:
            torch.export.save(program, handle, extra_files={"meta.json": json.dumps(meta)})
    return path


def _rewrite(source: Path, target: Path, change: dict[str, bytes]) -> Path:
    """``source`` with the members named in ``change`` (below its top folder) replaced."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            inner = info.filename.split("/", 1)[1]
            new.writestr(info, change.get(inner, old.read(info)))
    return target


@pytest.fixture
def four_band_cube(tmp_path: Path) -> Path:
    path = tmp_path / "cube.mat"
    rng = np.random.default_rng(0)
    scipy.io.savemat(path, {"cube": rng.random((9, 7, 4)).astype(np.float32)})
    return path


class _MkdirOnLoad:
    """Pickles to a call of os.mkdir: whoever unpickles it creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return os.mkdir, (self.path,)


def test_a_program_file_with_pickled_weights_is_refused_and_runs_nothing(
    tmp_path: Path, four_band_cube: Path
) -> None:
    import pickle

    honest = _program_file(tmp_path / "honest.pt")
    marker = tmp_path / "RAN"
    with zipfile.ZipFile(honest) as archive:
        config_name = next(n for n in archive.namelist() if n.endswith("weights_config.json"))
        config = json.loads(archive.read(config_name))
    config["config"]["network.0.weight"]["use_pickle"] = True
    hostile = _rewrite(
        honest,
        tmp_path / "hostile.pt",
        {
            "data/weights/model_weights_config.json": json.dumps(config).encode(),
            "data/weights/weight_0": pickle.dumps(_MkdirOnLoad(marker), protocol=2),
        },
    )
    out = tmp_path / "map.png"
    res = invoke(
        ["predict", "--model", str(hostile), "--cube", str(four_band_cube), "--out", str(out)]
    )
    assert not marker.exists()  # torch.export.load would have run it
    one_line_error(res, str(hostile), "'network.0.weight' is stored with pickle")
    assert not out.exists()
    with zipfile.ZipFile(honest) as archive:
        root = archive.namelist()[0].split("/", 1)[0]
    for extra, content in (
        ("data/aotinductor/model/model.so", b"\x7fELF"),
        ("data/weights/model.pt", pickle.dumps(_MkdirOnLoad(marker), protocol=2)),
        ("data/constants/opaque_obj_0", pickle.dumps(_MkdirOnLoad(marker), protocol=2)),
    ):
        planted = tmp_path / "planted.pt"
        planted.write_bytes(honest.read_bytes())
        with zipfile.ZipFile(planted, "a") as archive:
            archive.writestr(f"{root}/{extra}", content)
        res = invoke(
            ["predict", "--model", str(planted), "--cube", str(four_band_cube), "--out", str(out)]
        )
        assert not marker.exists()
        one_line_error(res, "refused", extra)


def _weights_config(path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("weights_config.json"))
        return json.loads(archive.read(name))


def _inflating(source: Path, target: Path, member: str, size: int) -> Path:
    """``source`` with ``member`` replaced by ``size`` zero bytes, deflated (a few KB)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            if info.filename.split("/", 1)[1] != member:
                new.writestr(info, old.read(info))
                continue
            with new.open(zipfile.ZipInfo(info.filename), "w", force_zip64=True) as out:
                for _ in range(size >> 20):
                    out.write(bytes(1 << 20))
    return target


def _bad_checksum(source: Path, target: Path, member: str) -> Path:
    """``source`` with one byte of ``member``'s stored data flipped."""
    data = bytearray(source.read_bytes())
    with zipfile.ZipFile(source) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(member))
        assert info.compress_type == zipfile.ZIP_STORED and info.file_size > 0
    header = info.header_offset
    name_len = int.from_bytes(data[header + 26 : header + 28], "little")
    extra_len = int.from_bytes(data[header + 28 : header + 30], "little")
    data[header + 30 + name_len + extra_len] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize("attack", ["inflating", "stride-0", "nested", "checksum"])
def test_a_malformed_program_file_gives_one_line_and_reads_nothing_big(
    tmp_path: Path, four_band_cube: Path, attack: str
) -> None:
    """A weight record that inflates far beyond its weight, a layout that repeats values into
    a tensor of 2^50, metadata nested 100,000 deep, a record whose checksum fails: each is
    one error line, and a record is read only up to what its weight's layout reaches."""
    honest = _program_file(tmp_path / "honest.pt")
    hostile = tmp_path / "hostile.pt"
    config = _weights_config(honest)
    first = config["config"]["network.0.weight"]
    record = f"data/weights/{first['path_name']}"
    if attack == "inflating":
        _inflating(honest, hostile, record, 256 << 20)
    elif attack == "stride-0":
        first["tensor_meta"]["sizes"] = [{"as_int": 1 << 25}] * 2
        first["tensor_meta"]["strides"] = [{"as_int": 0}] * 2
        change = {"data/weights/model_weights_config.json": json.dumps(config).encode()}
        _rewrite(honest, hostile, change)
    elif attack == "nested":
        _rewrite(honest, hostile, {"extra/meta.json": b"[" * 100_000 + b"]" * 100_000})
    else:
        _bad_checksum(honest, hostile, record)
    out = tmp_path / "map.png"
    res = invoke(
        ["predict", "--model", str(hostile), "--cube", str(four_band_cube), "--out", str(out)]
    )
    one_line_error(res, str(hostile))
    assert not out.exists()


def test_a_program_file_never_evaluates_its_graph(tmp_path: Path, four_band_cube: Path) -> None:
    """Symbolic shapes in the program's graph are parsed by sympy (an eval) when torch loads
    it; predict reads weights and metadata only, so an expression there never runs."""
    honest = _program_file(tmp_path / "honest.pt")
    marker = tmp_path / "RAN"
    with zipfile.ZipFile(honest) as archive:
        graph_name = next(n for n in archive.namelist() if n.endswith("models/model.json"))
        graph = archive.read(graph_name).decode()
    symbol = "Symbol('s77', positive=True, integer=True)"
    assert symbol in graph
    attack = graph.replace(symbol, f"__import__('os').mkdir('{marker}')")
    hostile = _rewrite(honest, tmp_path / "hostile.pt", {"models/model.json": attack.encode()})
    maps = {}
    for name, path in (("hostile", hostile), ("honest", honest)):
        npy = tmp_path / f"{name}.npy"
        args = ["--cube", str(four_band_cube), "--out", str(tmp_path / f"{name}.png")]
        res = invoke(["predict", "--model", str(path), *args, "--npy", str(npy)])
        assert not marker.exists()  # torch.export.load would have run it
        assert res.exit_code == 0, res.output
        maps[name] = np.load(npy)
    assert not marker.exists()
    assert np.array_equal(maps["hostile"], maps["honest"])
    # the honest file loaded by torch itself classifies exactly as predict does
    with honest.open("rb") as handle:
        program = torch.export.load(handle).module()
    from pserver.outputs.model_file import load_model

    patches = torch.from_numpy(np.random.default_rng(1).random((6, 4, PATCH, PATCH), np.float32))
    with torch.no_grad():
        assert torch.equal(program(patches), load_model(honest).module(patches))


def test_user_models_named_in_files_are_refused_unless_allowed(
    tmp_path: Path, four_band_cube: Path, small_hsi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pserver.snapshots import snapshots as snap

    package = tmp_path / "code"
    package.mkdir()
    (package / "evil_mod.py").write_text(EVIL_MODULE)
    monkeypatch.syspath_prepend(str(package))
    imported = package / "IMPORTED"
    model = "evil_mod:build"
    program = _program_file(tmp_path / "user.pt", model)
    weights = tmp_path / "user-weights.pt"
    with program.open("rb") as handle:
        extra = {"meta.json": ""}
        state = torch.export.load(handle, extra_files=extra).state_dict
    network = {k.removeprefix("network."): v for k, v in state.items() if k.startswith("network.")}
    meta = {**json.loads(extra["meta.json"]), "export": "state-dict"}
    torch.save({"format": meta["format"], "meta": meta, "state_dict": network}, weights)
    out = tmp_path / "map.png"
    for path in (weights, program):
        args = ["predict", "--model", str(path), "--cube", str(four_band_cube), "--out", str(out)]
        res = invoke(args)
        assert not imported.exists()  # the module was never imported
        one_line_error(res, f"--allow-model {model}")
    run_dir = tmp_path / "run"
    directory = run_dir / snap.DIRECTORY
    directory.mkdir(parents=True)
    with DatasetReader(small_hsi) as reader:
        fingerprint = reader.meta.fingerprint
    info = {"model": model, "dataset": str(small_hsi), "fingerprint": fingerprint}
    snap.write_run_file(directory, {**info, "state_size": 8, "every": 1, "mode": "async"})
    snap.write(directory, np.zeros(8, np.float32), snap.SnapshotMeta(1, 0, 0, 0.0))
    one_line_error(invoke(["evaluate-snapshots", str(run_dir)]), f"--allow-model {model}")
    assert not imported.exists()
    assert invoke([*args, "--allow-model", model]).exit_code == 0
    assert imported.exists() and out.is_file()


def test_export_reads_the_last_start_event_of_a_run_without_summary(tmp_path: Path) -> None:
    from pserver.outputs.export import _run_record

    lines = [{"event": "start", "dataset": "a.h5"}, {"event": "start", "dataset": "b.h5"}]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"event": "sta'
    (tmp_path / "metrics.jsonl").write_text(text, encoding="utf-8")
    assert _run_record(tmp_path) == {"summary": None, "start": lines[1]}
    assert _run_record(tmp_path / "absent") == {"summary": None, "start": None}
