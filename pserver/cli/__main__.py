"""``python -m pserver.cli``: the ``pserver`` command."""

import sys

from pserver.cli import main

sys.exit(main())
