"""Maps from a model trained on Jasper Ridge: test pixels scored, composite and confidence drawn."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from pserver.outputs.palette import (
    COLOURBLIND,
)


@pytest.mark.realdata
def test_predict_scores_test_pixels_and_draws_composite_and_confidence(
    jasper_h5: Path, jasper_dir: Path, tmp_path: Path
) -> None:
    from common.data.dataset import DatasetReader
    from pserver.cli import main
    from tests.support.runs import train

    summary = train(jasper_h5, tmp_path / "run", "hsi-cnn", epochs=1, workers=1)
    model = tmp_path / "model.pt"
    runner = CliRunner()
    res = runner.invoke(main, ["export", str(tmp_path / "run"), "--out", str(model)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "map.png"
    args = ["predict", "--model", str(model), "--cube", str(jasper_dir / "JasperRidge.mat")]
    res = runner.invoke(
        main,
        [
            *args,
            "--out",
            str(out),
            "--test-only",
            "--rgb-bands",
            "29,19,9",
            "--proba",
            str(tmp_path / "p.npy"),
            "--npy",
            str(tmp_path / "m.npy"),
            "--metrics",
            str(tmp_path / "s.json"),
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    with DatasetReader(jasper_h5) as reader:
        tests = len(reader.test_indices)
    wording = f"{tests} test pixels (training and guard-band pixels not scored)"
    assert f"  on {wording}\n" in res.output  # the scores say which pixels, in one word
    assert "labelled pixels" not in res.output
    assert wording in Image.open(out).text["Title"]
    scores = json.loads((tmp_path / "s.json").read_text())
    assert scores["labelled"] == tests and scores["scored"] == "test"
    # the map's test pixels are the server's test split: the same OA as its final evaluation
    assert scores["oa"] == pytest.approx(summary["final"]["oa"], abs=1e-6)
    proba = np.load(tmp_path / "p.npy")
    classes = np.load(tmp_path / "m.npy")
    assert proba.shape == (100, 100, 4) and proba.dtype == np.float32
    np.testing.assert_allclose(proba.sum(axis=2), 1.0, atol=1e-4)
    np.testing.assert_array_equal(proba.argmax(axis=2), classes)
    assert "colours: colour-blind-safe" in res.output
    # without --test-only the title says every labelled pixel was scored, training included
    res = runner.invoke(
        main,
        [*args, "--gt", str(jasper_dir / "JasperRidge_gt.mat"), "--out", str(out), "--no-progress"],
    )
    assert res.exit_code == 0, res.output
    assert "all 9639 labelled pixels (training pixels included)" in Image.open(out).text["Title"]
    image = np.asarray(Image.open(out).convert("RGB")).reshape(-1, 3).astype(int)
    water = np.abs(image - np.array(COLOURBLIND[0])).max(axis=1) <= 2
    assert water.sum() > 1000  # Jasper's water (class 2 of 4) is drawn in the palette's blue
