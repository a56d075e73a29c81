"""Helpers shared by the tests: processes, live in-process servers, Slurm jobs, real parts."""
