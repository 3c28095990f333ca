"""Work-item sets shared by the tests."""

from dmuon_ownership import WorkItem

LLAMA_8B_LAYER = (
    ("self_attn.q_proj", (4096, 4096)),
    ("self_attn.k_proj", (1024, 4096)),
    ("self_attn.v_proj", (1024, 4096)),
    ("self_attn.o_proj", (4096, 4096)),
    ("mlp.gate_proj", (14336, 4096)),
    ("mlp.up_proj", (14336, 4096)),
    ("mlp.down_proj", (4096, 14336)),
)


def llama_8b_items(layers: int = 32) -> list[WorkItem]:
    """The Muon matrices of a Llama-3-8B-shaped stack, one hook boundary per layer."""
    return [
        WorkItem(f"model.layers.{i}.{name}.weight", shape, f"model.layers.{i}")
        for i in range(layers)
        for name, shape in LLAMA_8B_LAYER
    ]
