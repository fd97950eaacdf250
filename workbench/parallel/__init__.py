"""Parallelism strategies built from torch.distributed primitives, one file per concept."""
