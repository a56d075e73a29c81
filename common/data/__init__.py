"""The dataset format, its reader and writer, splits, and converters from source formats."""

from pathlib import Path

# The shared real data beside the checkout: the Jasper Ridge cube and its class map.
JASPER_DIR = Path(__file__).resolve().parents[3] / "shared/datasets/jasper_ridge"
JASPER_FILES = ("JasperRidge.mat", "JasperRidge_gt.mat")
