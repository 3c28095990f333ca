"""dmuon_ns."""

__all__: list[str] = []
