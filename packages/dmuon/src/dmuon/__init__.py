"""dmuon: distributed Muon for PyTorch FSDP2 (re-exports only)."""

__all__: list[str] = []
