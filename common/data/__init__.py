"""The dataset format, its reader and writer, splits, and converters from source formats."""
