"""Slurm launch: job scripts (plain and heterogeneous), submission, and helpers run in jobs."""
