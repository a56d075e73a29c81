"""What the server, workers and the DDP baseline share about training: models, the flat layout,
metrics, slowdown emulation, evaluation, planning, speed measurement and the run log."""
