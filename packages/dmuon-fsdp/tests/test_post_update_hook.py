"""``Muon.register_post_update_hook``: a hook that rescales owners' weights between the update
and the publish; every rank computes the next forward with the rescaled weight, never the
unscaled one (1-D, HSDP async and sync, the replicated path)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import batch, loss_fn, muon_predicate
from _sgd_train import ddp_model, setup_model
from torch import nn

from dmuon_fsdp import Muon, Role, StepOptions, WeightPart
from dmuon_testing.distributed import run_distributed

ROWS = 8


def _model(world_size: int, path: str) -> nn.Module:
    if path == "ddp":
        return ddp_model(world_size)[0]
    model, _ = setup_model(
        world_size, replicate=2 if path.startswith("hsdp") else 1, small_param_threshold=0
    )
    return model


def _check(rank: int, world_size: int, path: str) -> dict[str, int]:
    model = _model(world_size, path)
    optimizer = Muon(model, lr=0.05, options=StepOptions(replicate_async=path != "hsdp_sync"))
    unscaled: dict[str, torch.Tensor] = {}
    scaled: dict[str, torch.Tensor] = {}
    seen_parts: list[set[str]] = []
    order: list[str] = []

    def halve_q(opt: Muon, parts: dict[str, WeightPart]) -> None:
        assert opt is optimizer
        order.append("halve_q")
        seen_parts.append(set(parts))
        for name, part in parts.items():
            if "q_proj" in name:
                assert part.offsets == (0, 0) and part.shape == tuple(part.tensor.shape)
                unscaled[name] = part.tensor.clone()
                part.tensor.mul_(0.5)
                scaled[name] = part.tensor.clone()

    handle = optimizer.register_post_update_hook(halve_q)
    # Registered later with prepend=True: it runs first.
    first = optimizer.register_post_update_hook(lambda *_: order.append("first"), prepend=True)
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name.endswith("q_proj"):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(
                    f"{name}.weight", m.weight.detach().clone()
                )
            )
    tokens = batch(0, ROWS).chunk(world_size)[rank]
    loss_fn(model, tokens).backward()
    optimizer.step()
    handle.remove()
    first.remove()
    assert order == ["first", "halve_q"], order

    # Every owner's before/after values, on every rank.
    owners: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{}] * world_size
    mine = {name: (unscaled[name], scaled[name]) for name in scaled}
    dist.all_gather_object(owners, mine)
    expected = {name: pair for table in owners for name, pair in table.items()}
    assert len(expected) == 2, sorted(expected)  # two layers' q_proj, each with one owner

    optimizer.zero_grad()
    loss_fn(model, tokens).backward()  # the next forward: what each rank computes with
    checked = 0
    for name, (before, after) in expected.items():
        assert torch.equal(seen[name], after), (path, rank, name)
        assert not torch.equal(seen[name], before), (path, rank, name)
        checked += 1
    # The hook saw exactly what this rank steps: its owned dedicated weights, plus FSDP2
    # shards (or, on the replicated path, the replicated parameters whole).
    owned = {n for n, _ in scaled.items()}
    dedicated_seen = {n for n in seen_parts[0] if muon_predicate(n, torch.empty(2, 2))}
    assert owned <= dedicated_seen
    optimizer.step()  # the removed hook does not run again
    return {"checked": checked, "calls": len(seen_parts)}


def _all_paths(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    return {p: _check(rank, world_size, p) for p in ("1d", "hsdp_async", "hsdp_sync", "ddp")}


@pytest.mark.distributed
def test_post_update_hook_reaches_every_rank_before_the_next_forward() -> None:
    for per_path in run_distributed(_all_paths, 4):
        for path, counts in per_path.items():
            assert counts == {"checked": 2, "calls": 1}, path


def test_register_post_update_hook_takes_a_callable() -> None:
    with pytest.raises(TypeError, match="register_post_update_hook takes a callable"):
        Muon.register_post_update_hook(object.__new__(Muon), "not a hook")  # type: ignore[arg-type]
    # Refused before the optimizer's hooks are read (an unbuilt Muon has none): nothing added.
    with pytest.raises(TypeError, match="register_post_update_hook: prepend must be a bool, got 1"):
        Muon.register_post_update_hook(object.__new__(Muon), print, prepend=1)  # type: ignore[arg-type]


class _HookFailed(BaseException):
    """Not an ``Exception``, as ``KeyboardInterrupt`` (Ctrl-C in a hook) is not one."""


def _raising_hook(rank: int, world_size: int, raising_ranks: tuple[int, ...]) -> dict:
    """HSDP 2 x 2: a hook that raises on ``raising_ranks`` after the update. Each step must
    end with every owner's replicas equal to it (the step applied everywhere), the hook's
    exception on the ranks where it raised, and, when it raised on some ranks only, the same
    error on every rank at the next step, which then changes nothing."""
    model, runtime = setup_model(world_size, replicate=2, small_param_threshold=0)
    optimizer = Muon(model, lr=0.05)

    def hook(opt: Muon, parts: dict[str, WeightPart]) -> None:
        if rank in raising_ranks:
            raise _HookFailed(f"rank {rank}")

    optimizer.register_post_update_hook(hook)
    tokens = batch(0, ROWS).chunk(world_size)[rank]
    raised: list[str] = []
    for _ in range(2):
        optimizer.zero_grad()
        loss_fn(model, tokens).backward()
        try:
            optimizer.step()
        except (_HookFailed, RuntimeError) as exc:
            raised.append(f"{type(exc).__name__}: {exc}")
    runtime.drain()
    # Each owner's weight and its replica's copy, everywhere.
    mine = {
        (dp.fqn, str(dp.role)): dp.param.detach().clone()
        for dp in runtime.params
        if dp.role is not Role.PEER
    }
    owners = {dp.fqn: dp.full.clone() for dp in runtime.owned if dp.full is not None}
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, (mine, owners))
    full = {name: w for _, table in everyone for name, w in table.items()}
    replicas_equal = all(
        torch.equal(w, full[fqn])
        for table, _ in everyone
        for (fqn, role), w in table.items()
        if role == "replica"
    )
    return {"raised": raised, "replicas equal": replicas_equal}


@pytest.mark.distributed
def test_a_raising_hook_leaves_every_replica_equal_and_reaches_every_rank() -> None:
    # Raising everywhere: every rank sees the hook's exception at each step, nothing more.
    for result in run_distributed(_raising_hook, 4, (0, 1, 2, 3)):
        assert result["replicas equal"]
        assert [r.split(":")[0] for r in result["raised"]] == ["_HookFailed", "_HookFailed"]
    # Raising on rank 0 only: rank 0 at once; at the next step every rank, before changing
    # anything (so no rank goes on alone).
    results = run_distributed(_raising_hook, 4, (0,))
    for rank, result in enumerate(results):
        assert result["replicas equal"], rank
        partial = "RuntimeError: a post-update hook raised on 1 of 4 ranks in the previous step"
        expected = [*(["_HookFailed: rank 0"] if rank == 0 else []), partial]
        assert [r[: len(e)] for r, e in zip(result["raised"], expected)] == expected, result
        assert len(result["raised"]) == len(expected), result


def _rebinding_hook(rank: int, world_size: int) -> list[str]:
    """A hook that rebinds a part (``.data =``) or replaces one in ``parts``: refused on every
    rank, naming the part, instead of a weight that silently stops reaching the forward."""
    model, _ = setup_model(world_size, small_param_threshold=0)
    optimizer = Muon(model, lr=0.05)
    raised = []
    for how in ("rebind", "replace"):

        def hook(opt: Muon, parts: dict[str, WeightPart], how: str = how) -> None:
            name = sorted(parts)[0]
            if how == "rebind":
                parts[name].tensor.data = parts[name].tensor.detach() * 0.5
            else:
                parts[name] = parts[name]._replace(tensor=parts[name].tensor.clone())

        handle = optimizer.register_post_update_hook(hook)
        optimizer.zero_grad()
        loss_fn(model, batch(0, ROWS).chunk(world_size)[rank]).backward()
        try:
            optimizer.step()
        except (RuntimeError, TypeError) as exc:
            raised.append(f"{type(exc).__name__}: {exc}")
        handle.remove()
    return raised


@pytest.mark.distributed
def test_a_hook_that_rebinds_or_replaces_a_part_is_refused_on_every_rank() -> None:
    for raised in run_distributed(_rebinding_hook, 2):
        rebind, replace = raised
        assert rebind.startswith("RuntimeError: a post-update hook gave these parts another")
        assert "never through .data =" in rebind
        assert replace.startswith("TypeError") and "does not support item assignment" in replace
