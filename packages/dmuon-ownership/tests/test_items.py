"""WorkItem validation: every error names the item and what to do."""

import pytest

from dmuon_ownership import Owner, Route, WorkItem


def test_work_item_normalises() -> None:
    item = WorkItem("a.weight", [8, 4], "layers.0", route="adamw")  # type: ignore[arg-type]
    assert item.shape == (8, 4)
    assert item.route is Route.ADAMW
    assert (item.numel, item.nbytes) == (32, 64)
    assert WorkItem("b", (3,), "", route=Route.SHARDED_ADAMW, itemsize=4, tp=2).nbytes == 12
    assert Owner(1, 2) == (1, 2) and Owner(1, 2).replicate == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, r"WorkItem.name must be a non-empty str, got ''"),
        ({"shape": (4, -1)}, r"WorkItem 'w': shape must be a sequence of non-negative ints"),
        ({"shape": 5}, r"WorkItem 'w': shape must be a sequence of non-negative ints, got 5"),
        ({"shape": (4, 2.0)}, r"shape must be a sequence of non-negative ints"),
        ({"boundary": None}, r"WorkItem 'w': boundary must be a str"),
        (
            {"route": "sgd"},
            r"WorkItem 'w': route: unknown route 'sgd'; use one of 'muon', 'adamw', 'sharded_adamw'",
        ),
        (
            {"shape": (16,)},
            r"WorkItem 'w': route 'muon' needs a matrix but shape is \(16,\); route it to 'adamw'",
        ),
        ({"itemsize": 0}, r"WorkItem 'w': itemsize must be an int >= 1, got 0"),
        ({"tp": True}, r"WorkItem 'w': tp must be an int >= 1, got True"),
    ],
)
def test_work_item_errors(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"name": "w", "shape": (4, 4), "boundary": "layers.0", **kwargs}
    with pytest.raises(ValueError, match=message):
        WorkItem(**args)  # type: ignore[arg-type]
