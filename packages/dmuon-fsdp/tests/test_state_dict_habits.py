"""torch's own state dicts used the usual way: ``model.state_dict()`` and parameter reads right
after ``step()``, and ``optimizer.state_dict()`` saved on rank 0 and loaded on every rank, on the
replicated (DDP) path and on the FSDP2 path."""

from __future__ import annotations

import io
import time
from typing import cast

import pytest
import torch
import torch.distributed as dist
from _models import build, muon_predicate, shard_layers_then_root
from _reference import Hyper, lm_loss, make_batch, shard
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dmuon_fsdp import Muon, dedicate_params, dedicate_params_ddp, replicate
from dmuon_fsdp.holder._pending import PendingParameter
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
ROWS, SEQ, VOCAB = 8, 8, 32
# Every weight of the layers computes in bf16 from an fp32 master on its owner; the norms and
# the MLP take the AdamW route.
BF16_LAYERS = {
    "defaults": {"param_dtype": "bfloat16", "master_dtype": "float32"},
    "overrides": [{"name": ["mlp", "attn_norm", "mlp_norm"], "set": {"route": "adamw"}}],
}


def _in_layers(name: str, param: nn.Parameter) -> bool:
    return name.startswith("layers.")


def _ddp(world_size: int, seed: int = 0, mixed: bool = False) -> nn.Module:
    model = build(seed)
    mesh = init_device_mesh("cpu", (world_size,))
    if mixed:
        dedicate_params_ddp(
            model, mesh, _in_layers, small_param_threshold=0, param_policy=BF16_LAYERS
        )
    else:
        dedicate_params_ddp(model, mesh, muon_predicate, small_param_threshold=0)
    replicate(model, mesh)
    return model


def _step(model: nn.Module, optimizer: Muon, step: int, rank: int, world_size: int) -> float:
    optimizer.zero_grad()
    loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
    loss.backward()
    optimizer.step()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total) / world_size


def _round_trip(value: object) -> object:
    """``value`` through torch.save / torch.load (weights only, torch's default)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# -- reads right after step() --------------------------------------------------------------------


def _record(used: dict[str, torch.Tensor], name: str):
    """A forward pre-hook that records the weight its ``nn.Linear`` computes with."""

    def hook(module: nn.Module, args: object) -> None:
        used[name] = module.weight.detach().clone()

    return hook


# Reads users make after step(), each the first read of its step in turn.
READS = {
    "model.state_dict()": lambda model: {k: v.clone() for k, v in model.state_dict().items()},
    "p.data": lambda model: {n: p.data.clone() for n, p in model.named_parameters()},
    "torch.save(model.state_dict())": lambda model: _round_trip(model.state_dict()),
    "torch.save(p)": lambda model: {
        n: _round_trip(p).detach() for n, p in model.named_parameters()
    },
}


def _reads_after_step(rank: int, world_size: int):
    stale: list[str] = []
    for mixed in (False, True):
        model = _ddp(world_size, mixed=mixed)
        optimizer = Muon(model, **HYPER.muon_kwargs())
        used: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(_record(used, f"{name}.weight"))
        read: dict[str, torch.Tensor] = {}
        how = ""
        for step in range(len(READS) + 1):
            used.clear()
            _step(model, optimizer, step, rank, world_size)
            # This forward's weights against what the reads after the last step returned.
            for name, weight in used.items():
                if read and not torch.equal(read[name], weight):
                    stale.append(f"mixed={mixed}, {how}: {name}")
            # zero_grad reads metadata only: the updates still overlap with what follows.
            optimizer.zero_grad()
            assert any(isinstance(p, PendingParameter) for p in model.parameters())
            how = list(READS)[step % len(READS)]
            read = READS[how](model)
            assert not any(isinstance(p, PendingParameter) for p in model.parameters())
    return stale


@pytest.mark.distributed
def test_ddp_reads_after_step_see_the_weights_the_next_forward_uses() -> None:
    # model.state_dict(), p.data, torch.save of the state dict or of one parameter, right after
    # step(): the weights the next forward computes with, on every rank (fp32, and bf16 compute
    # copies of fp32 masters).
    results = run_distributed(_reads_after_step, 2)
    assert results == [[], []], results


# -- writes right after step() -------------------------------------------------------------------


def _hsdp(world_size: int) -> nn.Module:
    """HSDP with one shard: every rank owns or replicates every matrix."""
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    dedicate_params(
        model,
        mesh["shard"],
        muon_predicate,
        replicate_mesh=mesh["replicate"],
        small_param_threshold=0,
    )
    shard_layers_then_root(model, mesh)
    return model


def _writes_after_step(rank: int, world_size: int) -> dict[str, object]:
    """Every weight halved in place on every rank right after a step, against the same halving
    loaded through ``set_model_state_dict``: every rank must hold the same weights after the
    write, and two more steps end bit for bit alike."""
    from dmuon_fsdp import get_model_state_dict, set_model_state_dict, wait_all_replicate_broadcasts

    makes = {
        "ddp": lambda: _ddp(world_size),
        "ddp bf16": lambda: _ddp(world_size, mixed=True),
        "hsdp": lambda: _hsdp(world_size),
    }
    found: dict[str, object] = {}
    for case, make in makes.items():
        finals = []
        for by_hand in (True, False):
            model = make()
            optimizer = Muon(model, **HYPER.muon_kwargs())
            _step(model, optimizer, 0, rank, world_size)
            # Rank 1 publishes late: rank 0's broadcasts wait for it, and so would read any
            # write rank 0 makes in the meantime.
            late = optimizer.register_post_update_hook(lambda *_: time.sleep(0.1 * rank))
            optimizer.zero_grad()
            lm_loss(model, shard(make_batch(1, ROWS, SEQ, VOCAB), rank, world_size)).backward()
            optimizer.step()
            late.remove()
            if by_hand:
                with torch.no_grad():  # while the owners' publish is in flight
                    for p in model.parameters():
                        p.mul_(0.5)
                wait_all_replicate_broadcasts(model)
                held = {n: _local_of(p) for n, p in model.named_parameters()}
                rank0 = _rank0(held)
                found[f"{case}: ranks agree"] = [
                    n for n, t in held.items() if not torch.equal(t, rank0[n])
                ]
            else:  # the weights the parameters read (a bf16 compute copy: its values), halved
                dtypes = {n: p.dtype for n, p in model.named_parameters()}
                masters = get_model_state_dict(model)
                set_model_state_dict(
                    model, {k: 0.5 * v.to(dtypes[k]).to(v.dtype) for k, v in masters.items()}
                )
            for s in range(2, 4):
                _step(model, optimizer, s, rank, world_size)
            finals.append(get_model_state_dict(model))
        by_hand_sd, loaded_sd = finals
        found[f"{case}: as loaded"] = [
            k for k in loaded_sd if not torch.equal(by_hand_sd[k], loaded_sd[k])
        ]
    return found


def _local_of(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``p`` (an FSDP2 parameter: its shard)."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


@pytest.mark.distributed
def test_weights_written_right_after_step_train_as_loaded_weights() -> None:
    # Written while the owners' publish was in flight, the other ranks received the halved
    # weight and halved it again (replicated path and HSDP); bf16 compute copies written on the
    # replicated path were stepped from their unwritten fp32 masters, the write lost.
    results = run_distributed(_writes_after_step, 2)
    wrong = {f"rank {r}, {k}": len(v) for r, res in enumerate(results) for k, v in res.items() if v}
    assert not wrong, wrong


def _assign_load(rank: int, world_size: int) -> tuple[str, bool]:
    """``model.load_state_dict(..., assign=True)`` on the replicated path, of the root and of one
    layer: its error, and whether the module still holds every parameter it held."""
    model = _ddp(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    _step(model, optimizer, 0, rank, world_size)
    held = [id(p) for p in model.parameters()]
    errors = []
    for module in (model, model.layers[1]):
        halved = {k: 0.5 * v.detach() for k, v in module.state_dict().items()}
        with pytest.raises(RuntimeError, match="assign=True") as error:
            module.load_state_dict(halved, assign=True)
        errors.append(str(error.value))
    _step(model, optimizer, 1, rank, world_size)  # trains on as before
    return errors[0], held == [id(p) for p in model.parameters()]


@pytest.mark.distributed
def test_an_assigning_load_is_refused_on_the_replicated_path() -> None:
    # It put new parameter objects in the modules, which no reduce, step or publish reached:
    # the matrices never moved again and the loss rose, without a word.
    for error, unchanged in run_distributed(_assign_load, 2):
        assert unchanged
        assert "'embed_tokens.weight' by a new parameter" in error, error
        assert "dmuon.set_model_state_dict" in error, error


# -- optimizer.state_dict() of rank 0, loaded on every rank ----------------------------------------


def _load(optimizer: Muon, state_dict: dict) -> str | None:
    """Load ``state_dict``; the error message if it raised (after checking nothing changed)."""
    before = {p: dict(s) for p, s in optimizer.state.items()}
    try:
        optimizer.load_state_dict(state_dict)
    except ValueError as error:
        assert {p: dict(s) for p, s in optimizer.state.items()} == before
        return str(error)
    return None


def _same_state(a: Muon, b: Muon) -> bool:
    pairs = list(zip(a.param_groups, b.param_groups))
    return all(
        (not a.state.get(p)) == (not b.state.get(q))
        and all(
            v.dtype == b.state[q][k].dtype and torch.equal(v, b.state[q][k])
            for k, v in a.state.get(p, {}).items()
        )
        for ga, gb in pairs
        for p, q in zip(ga["params"], gb["params"])
    )


def _rank0(value: object) -> object:
    """Rank 0's ``value``, saved and loaded as a checkpoint file would be, on every rank."""
    payload = [_round_trip(value) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _optimizer_dicts(rank: int, world_size: int):
    split, total = 2, 4
    errors: dict[str, str | None] = {}

    # DDP: the uninterrupted run, and the same run interrupted after `split` steps.
    model = _ddp(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    uninterrupted = [_step(model, optimizer, s, rank, world_size) for s in range(total)]
    model = _ddp(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    for s in range(split):
        _step(model, optimizer, s, rank, world_size)
    own = _round_trip(optimizer.state_dict())
    model_sd = _round_trip(model.state_dict())
    of_rank0 = _rank0(optimizer.state_dict())

    resumed = _ddp(world_size, seed=123)
    resumed.load_state_dict(model_sd)
    fresh = Muon(resumed, **HYPER.muon_kwargs())
    errors["ddp rank 0's dict"] = _load(fresh, of_rank0)
    if rank == 0:  # the rank that saved it: its state, bit for bit
        assert errors["ddp rank 0's dict"] is None and _same_state(fresh, optimizer)
    without = {k: v for k, v in of_rank0.items() if k != "dmuon_holdings"}
    errors["ddp rank 0's dict, no holdings"] = _load(Muon(resumed, **HYPER.muon_kwargs()), without)
    # Each rank's own dict resumes bit for bit.
    fresh = Muon(resumed, **HYPER.muon_kwargs())
    assert _load(fresh, own) is None
    tail = [_step(resumed, fresh, s, rank, world_size) for s in range(split, total)]
    resumes = tail == uninterrupted[split:]

    # DDP with bf16 compute copies: the loaded state keeps its fp32 dtype and bits (torch casts
    # state to the parameter's dtype, the bf16 copy's here).
    mixed = _ddp(world_size, mixed=True)
    optimizer = Muon(mixed, **HYPER.muon_kwargs())
    for s in range(split):
        _step(mixed, optimizer, s, rank, world_size)
    fresh = Muon(mixed, **HYPER.muon_kwargs())
    assert _load(fresh, _round_trip(optimizer.state_dict())) is None
    assert _same_state(fresh, optimizer)

    # FSDP2: each rank's dict holds its own shards and owned matrices.
    sharded = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(sharded, mesh, muon_predicate, small_param_threshold=0)
    shard_layers_then_root(sharded, mesh)
    optimizer = Muon(sharded, **HYPER.muon_kwargs())
    for s in range(split):
        _step(sharded, optimizer, s, rank, world_size)
    errors["fsdp2 rank 0's dict"] = _load(
        Muon(sharded, **HYPER.muon_kwargs()), _rank0(optimizer.state_dict())
    )
    fresh = Muon(sharded, **HYPER.muon_kwargs())
    assert _load(fresh, _round_trip(optimizer.state_dict())) is None
    assert _same_state(fresh, optimizer)

    # torch's state dict hooks around the whole of dmuon's methods: what a state_dict
    # post-hook saves loads (it lacked dmuon_holdings), a load pre-hook converts a dictionary
    # before it is checked (it came after: 'holds ['ns_steps'], which no step reads'), and a
    # load post-hook finds the owned matrices' states (it found none).
    seen: dict[str, object] = {}
    optimizer.register_state_dict_post_hook(lambda _, state: seen.update(saved=_round_trip(state)))
    optimizer.state_dict()
    hooked = Muon(sharded, **HYPER.muon_kwargs())
    hooked.register_load_state_dict_pre_hook(_without_ns_steps)
    hooked.register_load_state_dict_post_hook(
        lambda opt: seen.update(states=[bool(opt.state.get(dp.param)) for dp in opt.runtime.owned])
    )
    older = cast(dict, seen["saved"])
    older["param_groups"][0]["ns_steps"] = 5  # an older dmuon's dictionary, say
    assert _load(hooked, older) is None
    assert _same_state(hooked, optimizer)
    assert seen["states"] and all(cast(list, seen["states"])), seen["states"]
    return errors, resumes, _hook_calls(optimizer)


def _hook_calls(optimizer: torch.optim.Optimizer) -> list[tuple]:
    """torch's four state dict hooks on ``optimizer``, each twice (one ``prepend``), around a
    ``state_dict()`` and a ``load_state_dict()`` of what it returned (a key added): the calls,
    in order, and what each hook saw of the dictionary and of the values hooks before it
    returned."""
    calls: list[tuple] = []

    def added(o: torch.optim.Optimizer, sd: dict) -> dict:  # a new dictionary, used
        calls.append(("state_dict post", o is optimizer, "in_place" in sd))
        return {**sd, "added": 1}

    def in_place(o: torch.optim.Optimizer, sd: dict) -> None:  # changes the dictionary
        calls.append(("state_dict post, prepended", o is optimizer, "added" in sd))
        sd["in_place"] = 2

    def stripped(o: torch.optim.Optimizer, sd: dict) -> dict:  # torch's key conversion
        calls.append(("load pre", o is optimizer, "given" in sd, sd is given))
        return {k: v for k, v in sd.items() if k not in ("added", "in_place")}

    def popped(o: torch.optim.Optimizer, sd: dict) -> None:  # on torch's copy, not on `given`
        calls.append(("load pre, prepended", o is optimizer, sorted({"added", "given"} & set(sd))))
        sd.pop("given")

    optimizer.register_state_dict_pre_hook(lambda o: calls.append(("pre", o is optimizer)))
    optimizer.register_state_dict_pre_hook(
        lambda o: calls.append(("pre, prepended", o is optimizer)), prepend=True
    )
    optimizer.register_state_dict_post_hook(added)
    optimizer.register_state_dict_post_hook(in_place, prepend=True)
    optimizer.register_load_state_dict_pre_hook(stripped)
    optimizer.register_load_state_dict_pre_hook(popped, prepend=True)
    optimizer.register_load_state_dict_post_hook(
        lambda o: calls.append(("load post", o is optimizer, bool(o.state)))
    )
    saved = optimizer.state_dict()
    calls.append(("returned", sorted({"added", "in_place"} & set(saved))))
    given = {**saved, "given": 3}
    optimizer.load_state_dict(given)
    calls.append(("given kept", "given" in given))
    return calls


def _without_ns_steps(optimizer: Muon, state_dict: dict) -> dict:
    """A load pre-hook, torch's way to convert an older dictionary: drops ``ns_steps``."""
    groups = [{k: v for k, v in g.items() if k != "ns_steps"} for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


@pytest.mark.distributed
def test_rank0_optimizer_state_dict_loaded_everywhere_resumes_or_raises() -> None:
    results = run_distributed(_optimizer_dicts, 2)
    # torch's state dict hooks run on Muon as on torch's AdamW: the same calls, in the same
    # order, with the same arguments, the dictionaries they return used alike.
    model = nn.Linear(4, 4)
    adamw = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    adamw.step()
    torch_calls = _hook_calls(adamw)
    for *_, calls in results:
        assert calls == torch_calls, (calls, torch_calls)
    for rank, (errors, resumes, _) in enumerate(results):
        assert resumes, f"rank {rank}: its own optimizer.state_dict() did not resume bit for bit"
        for case, error in errors.items():
            if rank == 0:
                assert error is None, f"rank 0, {case}: {error}"
            else:
                assert error is not None, f"rank 1, {case}: loaded without an error"
                assert "dmuon.get_optimizer_state_dict" in error, error
                assert "dmuon.set_optimizer_state_dict" in error, error
    # Rank 1 names what it lacks.
    assert "saved on rank 0" in results[1][0]["ddp rank 0's dict"]


def _zeroing(rank: int, world_size: int) -> tuple[list[float], list[float], list[float]]:
    """Losses of three runs that clear gradients three ways: ``optimizer.zero_grad()``,
    ``model.zero_grad()`` (the Hugging Face Trainer's way) and, on the DDP path,
    ``model.zero_grad()`` again."""

    def fsdp() -> nn.Module:
        model = build(0)
        mesh = init_device_mesh("cpu", (world_size,))
        dedicate_params(model, mesh, muon_predicate, small_param_threshold=0)
        shard_layers_then_root(model, mesh)
        return model

    runs = []
    for make, through_model in ((fsdp, False), (fsdp, True), (lambda: _ddp(world_size), True)):
        model = make()
        optimizer = Muon(model, **HYPER.muon_kwargs())
        losses = []
        for step in range(3):
            (model if through_model else optimizer).zero_grad()
            loss = lm_loss(model, shard(make_batch(step, ROWS, SEQ, VOCAB), rank, world_size))
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        runs.append(losses)
    return runs[0], runs[1], runs[2]


@pytest.mark.distributed
def test_model_zero_grad_clears_the_owners_gradients() -> None:
    # Without it the owners would add every step's gradient to the previous ones while FSDP2's
    # start afresh, and the losses part from the third step on.
    for by_optimizer, by_model, ddp in run_distributed(_zeroing, 2):
        assert by_model == by_optimizer
        torch.testing.assert_close(torch.tensor(ddp), torch.tensor(by_optimizer), rtol=1e-5, atol=0)


def _fsdp2(world_size: int) -> tuple[nn.Module, Muon]:
    # Each layer's matrices packed onto one owner: layer i on rank i, at 4 ranks as at 2.
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, muon_predicate)
    shard_layers_then_root(model, mesh)
    return model, Muon(model, **HYPER.muon_kwargs())


def _saved_per_rank(rank: int, world_size: int) -> dict:
    model, optimizer = _fsdp2(world_size)
    _step(model, optimizer, 0, rank, world_size)
    return _round_trip(optimizer.state_dict())


def _loaded_on_fewer_ranks(rank: int, world_size: int, saved: list[dict]) -> list[str | None]:
    model, optimizer = _fsdp2(world_size)
    mine = saved[rank]
    without = {k: v for k, v in mine.items() if k != "dmuon_holdings"}
    errors = [_load(optimizer, mine), _load(optimizer, without)]
    _step(model, optimizer, 1, rank, world_size)  # the refused loads left a usable optimizer
    return errors


@pytest.mark.distributed
def test_a_per_rank_dict_of_another_world_size_is_refused() -> None:
    # Ranks 0 and 1 own the same matrices at both sizes, but rank r of 4 and rank r of 2 hold
    # other rows of every FSDP2 shard: torch's load paired them anyway, and its fused AdamW
    # then wrote past the smaller shard (a heap corruption).
    saved = run_distributed(_saved_per_rank, 4)
    results = run_distributed(_loaded_on_fewer_ranks, 2, saved)
    for rank, (with_holdings, without) in enumerate(results):
        assert with_holdings is not None
        assert f"saved on rank {rank} of 4 (this is rank {rank} of 2)" in with_holdings
        assert "dmuon.set_optimizer_state_dict" in with_holdings
        assert without is not None and "Nothing was loaded" in without, without


def _z2_after_evaluation(rank: int, world_size: int, tie: bool) -> dict[str, object]:
    """Z2 with FSDP2 computing in bf16 keeps the compute copies after an evaluation forward
    ([Note: state dicts see the parameters]): a layer's ``state_dict(keep_vars=True)`` then
    holds what it holds after a step (the owner's fp32 master, a peer's ``NotHeldError`` at a
    read), its refused ``state_dict()`` and the whole model's change nothing and leave every
    rank holding the same layers, and training goes on bit for bit like a run without the
    evaluation and the reads. With ``tie`` the matrix read is the embedding that the head is
    tied to, through the head's own ``state_dict`` (before, that name alone read the bf16
    compute copy on every rank, while the embedding's dropped it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from dmuon_fsdp import NotHeldError, dedicated_params_of, get_model_state_dict

    runs = {}
    for evaluate in (True, False):
        model = build(0, tie=tie)
        mesh = init_device_mesh("cpu", (world_size,))
        predicate = lambda n, p: muon_predicate(n, p) or (tie and n == "lm_head.weight")  # noqa: E731
        dedicate_params(model, mesh, predicate, reshard_after_forward=False)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ignored = dedicated_params_of(model)
        for layer in model.layers:
            fully_shard(
                layer, mesh=mesh, mp_policy=mp, ignored_params=ignored, reshard_after_forward=False
            )
        fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored)
        optimizer = Muon(model, **HYPER.muon_kwargs())
        _step(model, optimizer, 0, rank, world_size)
        name = "embed_tokens.weight" if tie else "layers.0.attn.q_proj.weight"
        module, key = (model.lm_head, "weight") if tie else (model.layers[0], "attn.q_proj.weight")
        if evaluate:
            with torch.no_grad():
                lm_loss(model, shard(make_batch(9, ROWS, SEQ, VOCAB), rank, world_size))
            # The first layer's matrices, all on one owner. Its values are refused on every
            # rank (some rank does not hold them); keep_vars lists the parameters, which the
            # owner reads.
            with pytest.raises(NotHeldError, match="refused on every rank"):
                module.state_dict()
            try:
                read = module.state_dict(keep_vars=True)[key].detach().clone()
            except NotHeldError:
                read = None
            full = get_model_state_dict(model)[name]
            owner = any(dp.fqn == name for dp in optimizer.runtime.owned)
            runs["read"] = (owner, read is None or torch.equal(read, full), read)
            # The whole model's, on every rank after another evaluation: refused on every
            # rank, and every rank must still hold the same layers, dmuon's and FSDP2's, or
            # the next forward gathers on some ranks only (it hung when each rank raised at
            # the first weight it did not own).
            with torch.no_grad():
                lm_loss(model, shard(make_batch(9, ROWS, SEQ, VOCAB), rank, world_size))
            with pytest.raises(NotHeldError):
                model.state_dict()
            held: list[object] = [None] * world_size
            fsdp_sharded = [isinstance(layer.attn_norm.weight, DTensor) for layer in model.layers]
            dist.all_gather_object(
                held, ([g.status for g in optimizer.runtime.groups], fsdp_sharded)
            )
            if held.count(held[0]) != world_size:  # the step below would hang
                return {"every rank holds the same layers after the raise": False, "held": held}
        _step(model, optimizer, 1, rank, world_size)
        runs[evaluate] = get_model_state_dict(model)
    owner, equal, read = runs["read"]
    return {
        "owner reads the master": not owner or (read is not None and equal),
        "peer raises": owner or read is None,
        "same training": all(torch.equal(runs[True][k], runs[False][k]) for k in runs[False]),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied-head"])
def test_z2_state_dict_after_an_evaluation_reads_as_after_a_step(tie: bool) -> None:
    for result in run_distributed(_z2_after_evaluation, 2, tie):
        assert all(result.values()), result
