"""dmuon_fsdp."""

__all__: list[str] = []
