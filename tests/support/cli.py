"""What a command line shows a user when it fails."""

from __future__ import annotations

from typing import Any


def one_line_error(res: Any, *fragments: str) -> None:
    """``res`` (a click result) failed with exit code 1 and one ``Error:`` line holding every
    fragment, no traceback."""
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert "Traceback" not in res.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
