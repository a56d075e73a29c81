"""Converters from source formats (.mat cubes, image folders, synthetic data) to the dataset format."""
