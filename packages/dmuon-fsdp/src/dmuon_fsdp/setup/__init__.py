"""How a model gets its runtime: ``dedicate_params`` (FSDP2 and HSDP), the replicated (DDP)
path, and how a later ``fully_shard`` leaves dedicated parameters alone."""
