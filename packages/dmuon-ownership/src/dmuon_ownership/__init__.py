"""dmuon_ownership."""

__all__: list[str] = []
