"""``python -m bench``: the benches' command line."""

from bench.cli import main

main()
