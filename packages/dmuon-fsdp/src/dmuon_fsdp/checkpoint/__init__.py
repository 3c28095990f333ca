"""Checkpoints: the layout both formats share, full state dicts, and sharded DCP checkpoints."""
