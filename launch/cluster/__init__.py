"""Emulated heterogeneous clusters on one machine: a CPU budget and a link per node."""
