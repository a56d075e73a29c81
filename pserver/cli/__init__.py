"""The ``pserver`` command line: the server's commands and the data, model and snapshot groups.

``main`` is the ``pserver`` console script; ``python -m pserver.cli`` runs it too.
"""

from __future__ import annotations

from pserver.cli.server_cli import main

__all__ = ["main"]
