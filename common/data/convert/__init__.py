"""Converters from source formats (.mat cubes, image folders, synthetic scenes) to datasets."""
