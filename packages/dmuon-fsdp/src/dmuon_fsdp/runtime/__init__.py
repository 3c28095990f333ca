"""The runtime around a hook boundary: dedicated parameters and their dtypes, packs, the
broadcast and reduce collectives, the boundary groups and their hooks, the guard on weights a
rank does not hold, and the ``DedicatedRuntime`` that holds it all for one model."""
