"""dmuon_clip."""

__all__: list[str] = []
