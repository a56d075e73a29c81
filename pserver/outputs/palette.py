"""Class colours for maps: a colour-blind-safe default, user palettes, and the ground truth's own.

``--palette`` takes ``auto`` (the ground-truth file's colours where it has them, else
``colourblind``), ``colourblind`` (Okabe and Ito's eight colours without black, given by class
name where a name says what the class is: water blue, vegetation green, bare ground orange,
built-up vermillion; ``BY_NAME``), ``tab20`` (matplotlib's, dark colours first), or explicit
colours: ``#0072b2,#e69f00,...`` in class order or ``water=#0072b2,soil=#a0522d`` by class
name (other classes keep the default). Agreement panels are drawn in colours no class uses
(``distinct``).
"""

from __future__ import annotations

import colorsys
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common.errors import DatasetError

RGB = tuple[int, int, int]

# Okabe & Ito (2008), "Color Universal Design", without black (black marks unlabelled pixels).
COLOURBLIND: tuple[RGB, ...] = (
    (0, 114, 178),  # blue
    (230, 159, 0),  # orange
    (0, 158, 115),  # bluish green
    (204, 121, 167),  # reddish purple
    (86, 180, 233),  # sky blue
    (213, 94, 0),  # vermillion
    (240, 228, 66),  # yellow
)
# The first class whose name matches a rule gets the rule's colour; the others keep the
# palette's order. Words of common land-cover legends (Jasper Ridge, Samson, Indian Pines,
# Pavia, Salinas, EuroSAT).
BY_NAME = tuple(
    (re.compile(words, re.IGNORECASE), colour)
    for words, colour in (
        (r"water|sea|lake|river|ocean|lagoon|pond|reservoir", COLOURBLIND[0]),
        (r"tree|forest|wood|veget|grass|meadow|crop|corn|soy|wheat|alfalfa|oats|pasture|shrub|"
         r"bush|orchard|vineyard|lettuce|celery|broccoli|hay|leaf|plant", COLOURBLIND[2]),
        (r"soil|dirt|rock|sand|bare|earth|gravel|clay|mud|desert|stone|fallow", COLOURBLIND[1]),
        (r"road|asphalt|street|urban|build|roof|concrete|brick|metal|paved|parking|residential|"
         r"industrial|highway|railway|bitumen|tile", COLOURBLIND[5]),
    )
)  # fmt: skip
UNLABELLED: RGB = (0, 0, 0)
# Candidates for the agreement panel, the first far from every class colour is taken.
CORRECT_CANDIDATES: tuple[RGB, ...] = ((215, 215, 215), (255, 255, 255), (170, 170, 170))
WRONG_CANDIDATES: tuple[RGB, ...] = ((255, 0, 255), (128, 0, 0), (255, 0, 0), (90, 0, 140))
MIN_DISTANCE = 60.0  # RGB distance below which two colours count as the same


def extend(base: Sequence[RGB], num_classes: int) -> list[RGB]:
    """``base`` for the first classes, then evenly spread hues (no greys, never black).

    Args:
        base: the palette's own colours.
        num_classes: K.

    Returns:
        K colours; the same inputs always give the same list.
    """
    out = list(base[:num_classes])
    golden = 0.618033988749895
    for k in range(len(out), num_classes):
        hue = (k * golden) % 1.0
        light = 0.45 if k % 2 else 0.6
        r, g, b = colorsys.hls_to_rgb(hue, light, 0.75)
        out.append((round(r * 255), round(g * 255), round(b * 255)))
    return out


def by_name(table: list[RGB], names: Sequence[str]) -> list[RGB]:
    """Give the first class each ``BY_NAME`` rule matches that rule's colour (swapping
    colours, so every colour stays used once); the other classes keep theirs."""
    out, claimed = list(table), set()
    for pattern, colour in BY_NAME:
        k = next((k for k, n in enumerate(names) if k not in claimed and pattern.search(n)), None)
        if k is None:
            continue
        if colour in out:
            out[out.index(colour)] = out[k]
        out[k] = colour
        claimed.add(k)
    return out


def parse_colour(text: str) -> RGB:
    """``#rrggbb`` or ``r/g/b`` (0-255) as an RGB triple.

    Raises:
        DatasetError: the text is neither.
    """
    text = text.strip()
    if re.fullmatch(r"#[0-9a-fA-F]{6}", text):
        return (int(text[1:3], 16), int(text[3:5], 16), int(text[5:7], 16))
    parts = text.split("/")
    if len(parts) == 3 and all(p.isdigit() and int(p) <= 255 for p in parts):
        return (int(parts[0]), int(parts[1]), int(parts[2]))
    raise DatasetError(f"colour must be #rrggbb or r/g/b (0-255), got {text!r}")


def resolve_palette(
    spec: str, names: Sequence[str], from_gt: Sequence[RGB] | None = None
) -> tuple[list[RGB], str]:
    """The colour of each class.

    Args:
        spec: ``auto``, a built-in name, colours in class order, or ``name=colour`` pairs.
        names: the K class names.
        from_gt: colours found in the ground-truth file (used by ``auto``).

    Returns:
        ``(colours, where)``: K RGB triples and a few words on where they came from.

    Raises:
        DatasetError: the spec is not understood, names an unknown class, or gives fewer
            colours than classes.
    """
    k = len(names)
    default = by_name(extend(COLOURBLIND, k), names)
    spec = spec.strip()
    if spec == "auto":
        if from_gt is not None and len(from_gt) >= k:
            return list(from_gt[:k]), "the ground truth's colours"
        return default, "colour-blind-safe (Okabe-Ito)"
    if spec.lower() == "tab20":  # its ten dark colours, then their light partners
        from matplotlib import colormaps

        tab = [
            (round(r * 255), round(g * 255), round(b * 255))
            for r, g, b, _ in colormaps["tab20"](range(20))
        ]
        return extend(tab[0::2] + tab[1::2], k), "tab20"
    if spec.lower() in ("colourblind", "colorblind"):
        return default, spec.lower()
    items = [i for i in spec.split(",") if i.strip()]
    if items and all("=" in i for i in items):
        out = list(default)
        lookup = {n.lower(): i for i, n in enumerate(names)}
        for item in items:
            name, colour = item.split("=", 1)
            if name.strip().lower() not in lookup:
                raise DatasetError(f"--palette names class {name.strip()!r}; classes are {names}")
            out[lookup[name.strip().lower()]] = parse_colour(colour)
        return out, "--palette by name, the rest colour-blind-safe"
    colours = [parse_colour(i) for i in items]
    if len(colours) < k:
        raise DatasetError(
            f"--palette gives {len(colours)} colours for {k} classes; give one per class, "
            "name=colour pairs, auto, colourblind or tab20"
        )
    return colours[:k], "--palette"


def distinct(candidates: Sequence[RGB], used: Sequence[RGB]) -> RGB:
    """The first candidate at least ``MIN_DISTANCE`` from every colour in ``used``.

    Falls back to the candidate farthest from them.
    """
    taken = np.asarray(used, dtype=np.float64).reshape(-1, 3)
    best, best_gap = candidates[0], -1.0
    for c in candidates:
        gap = float(np.min(np.linalg.norm(taken - np.asarray(c), axis=1))) if taken.size else 1e9
        if gap >= MIN_DISTANCE:
            return c
        if gap > best_gap:
            best, best_gap = c, gap
    return best


def ground_truth_colours(spec: str) -> list[RGB] | None:
    """Class colours stored with a ground-truth map, for classes 1..K.

    Read from a .mat variable ``class_colours``/``class_colors``/``palette`` (K x 3, 0-1 or
    0-255) or an ENVI header's ``class lookup`` (its first triple is class 0, dropped).
    GeoTIFF colour tables are not read.

    Args:
        spec: the ``--gt`` value.

    Returns:
        The colours, or None when the file has none.

    Raises:
        DatasetError: a colour variable exists but is not K x 3 numbers.
    """
    from common.data.convert.cube import source_format

    fmt, path, _ = source_format(spec)
    if fmt == "mat":
        from common.data.convert.matfile import load_mat_array, mat_variables

        held = {n for n, _, _ in mat_variables(path)}
        key = next((k for k in ("class_colours", "class_colors", "palette") if k in held), None)
        if key is None:
            return None
        table = np.asarray(load_mat_array(f"{path}:{key}"), dtype=np.float64)
        return _triples(table, f"{path}:{key}")
    if fmt == "envi":
        return _envi_lookup(path)
    return None


def _triples(table: np.ndarray, where: str) -> list[RGB]:
    if table.ndim != 2 or table.shape[1] != 3 or not np.all(np.isfinite(table)):
        raise DatasetError(f"class colours {where} must be K x 3 numbers, got {table.shape}")
    if table.max(initial=0) <= 1.0:
        table = table * 255
    table = np.clip(np.round(table), 0, 255).astype(int)
    return [(int(r), int(g), int(b)) for r, g, b in table]


def _envi_lookup(path: Path) -> list[RGB] | None:
    header = path if path.suffix.lower() == ".hdr" else path.with_suffix(".hdr")
    if not header.is_file():
        header = Path(str(path) + ".hdr")
    text = header.read_text(errors="replace") if header.is_file() else ""
    match = re.search(r"class\s+lookup\s*=\s*\{([^}]*)\}", text, re.IGNORECASE)
    if match is None:
        return None
    values = np.array([float(v) for v in re.findall(r"[-+]?\d+(?:\.\d+)?", match.group(1))])
    if values.size < 6 or values.size % 3:
        return None
    return _triples(values.reshape(-1, 3)[1:], str(header))
