"""The optimizer: ``Muon`` and its step phases, the Muon and AdamW math, the fused Triton
passes, semantic param groups, and Newton–Schulz of tensor-parallel matrices."""
