"""Tensor parallelism: the process group and the collectives the sharded layers call."""
