"""Where the ranks are and how they talk: the data-parallel grid (1-D, HSDP, one grid per
tensor-parallel index) and the comm context (process groups, streams, byte counter)."""
