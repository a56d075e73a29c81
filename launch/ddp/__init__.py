"""The torch.distributed DDP baseline: launcher, one rank, its step and rank 0's records."""
