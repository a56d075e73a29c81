"""Model snapshots: the file format and writer, the hook that takes them, their evaluation."""
