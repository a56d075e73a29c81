"""What a split delivered: realised per-class train/test counts beside the requested fraction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.data.dataset import DatasetMeta

RELATIVE_TOLERANCE = 0.1  # of the requested fraction; at least one pixel of the class


@dataclass(frozen=True)
class ClassSplit:
    """One class's share of a split.

    Attributes:
        name: the class name.
        labelled: labelled pixels (or samples) of the class before splitting.
        train: training samples.
        test: test samples.
    """

    name: str
    labelled: int
    train: int
    test: int

    @property
    def left_out(self) -> int:
        """Samples in neither split (a disjoint split's guard band)."""
        return self.labelled - self.train - self.test

    @property
    def train_fraction(self) -> float:
        """Realised training fraction of the class's labelled samples."""
        return self.train / self.labelled if self.labelled else 0.0


def within_tolerance(requested: float, row: ClassSplit) -> bool:
    """True when the realised training fraction is within the documented tolerance.

    The tolerance is ``RELATIVE_TOLERANCE`` of the requested fraction or one sample of the
    class, whichever is larger (a class of 7 pixels cannot realise 0.1 closer than 1/7).
    """
    if row.labelled == 0:
        return True
    allowed = max(RELATIVE_TOLERANCE * requested, 1.0 / row.labelled)
    return abs(row.train_fraction - requested) <= allowed + 1e-12


def class_splits(meta: DatasetMeta) -> list[ClassSplit]:
    """Per-class counts of a dataset file.

    Args:
        meta: the file's metadata; ``labelled_per_class`` (written by ``prepare hsi``) gives
            the labelled counts, else train + test.

    Returns:
        One ``ClassSplit`` per class.
    """
    train, test = meta.class_counts["train"], meta.class_counts["test"]
    labelled: Sequence[int] = meta.attrs.get("labelled_per_class") or [
        a + b for a, b in zip(train, test, strict=True)
    ]
    return [
        ClassSplit(str(name), int(n), int(a), int(b))
        for name, n, a, b in zip(meta.class_names, labelled, train, test, strict=True)
    ]


def split_warnings(
    rows: Sequence[ClassSplit], requested: float, patch: int | None, split: str
) -> list[str]:
    """One line per problem, each with what to change.

    Args:
        rows: per-class counts.
        requested: the requested training fraction.
        patch: the patch side (None for whole images).
        split: ``random`` or ``disjoint``.

    Returns:
        Warning lines (no prefix); empty when the split keeps its promise.
    """
    smaller = "a smaller --patch or --train-fraction" if patch else "a smaller --train-fraction"
    out = [
        f"class {row.name!r}: {row.train_fraction:.3f} of its {row.labelled} pixels train, "
        f"{requested:g} requested (tolerance ±{RELATIVE_TOLERANCE:.0%} of it or one pixel); a "
        "class this small cannot be split closer: merge it or leave it out"
        for row in rows
        if row.labelled and not within_tolerance(requested, row)
    ]
    empty = [row for row in rows if row.labelled and row.test == 0]
    if empty:
        which = ", ".join(f"{r.name!r} ({r.train} train, {r.left_out} left out)" for r in empty)
        out.append(
            f"{'class' if len(empty) == 1 else 'classes'} {which} "
            f"{'has' if len(empty) == 1 else 'have'} no test samples, so "
            f"{'its' if len(empty) == 1 else 'their'} accuracy cannot be measured; try {smaller}"
        )
    if split == "disjoint":
        thin = [r for r in rows if 0 < r.test < 0.5 * (r.labelled - r.train)]
        if thin:
            which = ", ".join(f"{r.name!r} {r.test}/{r.labelled - r.train}" for r in thin)
            out.append(
                f"the guard band leaves less than half of the non-training pixels for testing "
                f"(test/non-training: {which}); {smaller} keeps more"
            )
    return out


def split_table(rows: Sequence[ClassSplit], requested: float, split: str) -> list[str]:
    """The per-class table printed after a split.

    Args:
        rows: per-class counts.
        requested: the requested training fraction.
        split: ``random`` or ``disjoint``.

    Returns:
        Lines of text.
    """
    width = max([len(r.name) for r in rows] + [5])
    lines = [
        f"{split} split, train fraction {requested:g} requested per class "
        f"(tolerance ±{RELATIVE_TOLERANCE:.0%} of it or one pixel):",
        f"  {'class':<{width}}  {'labelled':>8}  {'train':>7}  {'test':>7}  "
        f"{'left out':>8}  {'train fraction':>14}",
    ]
    for r in rows:
        lines.append(
            f"  {r.name:<{width}}  {r.labelled:>8}  {r.train:>7}  {r.test:>7}  "
            f"{r.left_out:>8}  {r.train_fraction:>14.3f}"
        )
    return lines
