"""Watching a running server: the status page, its live view and the ``/metrics`` exposition."""
