"""Checkpoints: resume reproduces the uninterrupted run bit for bit, the model dictionary loads
into a plain model, and bad checkpoints raise before anything is modified."""

from __future__ import annotations

import pytest
import torch
from _models import build, muon_predicate, shard_layers_then_root, wrap_all_gather
from _reference import Hyper, lm_loss, make_batch
from test_training import ROWS, SEQ, VOCAB, counting_muon, make_mesh, setup_model, train_steps
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._pytree import tree_flatten

from dmuon_fsdp import (
    Muon,
    StepOptions,
    dedicate_params,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from dmuon_fsdp.checkpoint._state_layout import fresh_state
from dmuon_ownership import Route
from dmuon_testing.distributed import run_distributed
from dmuon_testing.memory import StoragePeak, live_storages, storage_of

HYPER = Hyper(weight_decay=0.02)
TOTAL, SPLIT = 6, 3


def _resume(rank: int, world_size: int, reshard: bool):
    model, _ = setup_model(world_size, reshard=reshard)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    uninterrupted = train_steps(model, optimizer, rank, world_size, TOTAL)

    model, _ = setup_model(world_size, reshard=reshard)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    first = train_steps(model, optimizer, rank, world_size, SPLIT)
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer)

    # A fresh model with other initial weights and a fresh optimizer, then the checkpoint.
    resumed, _ = setup_model(world_size, reshard=reshard, seed=123)
    resumed_opt = Muon(resumed, **HYPER.muon_kwargs())
    set_model_state_dict(resumed, model_sd)
    set_optimizer_state_dict(resumed, resumed_opt, optim_sd)
    second = train_steps(resumed, resumed_opt, rank, world_size, TOTAL - SPLIT, start=SPLIT)

    # The flat dictionary loads into a plain single-process model and computes the same loss.
    plain = build(7)
    plain.load_state_dict(model_sd, strict=True)
    tokens = make_batch(SPLIT, ROWS, SEQ, VOCAB)
    plain_loss = float(lm_loss(plain, tokens).detach())
    # And a round trip through the plain model's own state_dict reproduces the dictionary.
    again, _ = setup_model(world_size, reshard=reshard, seed=5)
    set_model_state_dict(again, plain.state_dict())
    round_trip = get_model_state_dict(again)
    same = all(torch.equal(round_trip[k], v) for k, v in model_sd.items())
    # Momentum and Adam moments are complete full tensors.
    kinds = {k: sorted(v) for k, v in optim_sd["state"].items()}
    return uninterrupted, first + second, plain_loss, same, kinds, sorted(optim_sd["param_groups"])


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "reshard"), [(2, True), (4, False)], ids=["w2-z3", "w4-z2"])
def test_resume_is_bit_exact(world_size, reshard):
    results = run_distributed(_resume, world_size, reshard)
    uninterrupted, resumed, plain_loss, same, kinds, groups = results[0]
    assert resumed == uninterrupted, "resume must reproduce the uninterrupted run bit for bit"
    assert same
    # The plain model's loss on the next global batch is the one dmuon's step SPLIT reported.
    assert plain_loss == pytest.approx(uninterrupted[SPLIT], rel=1e-5)
    assert groups == ["adamw", "muon"]
    model = build(0)
    for name, p in model.named_parameters():
        want = (
            ["momentum_buffer"]
            if ("proj" in name and p.ndim == 2)
            else [
                "exp_avg",
                "exp_avg_sq",
                "step",
            ]
        )
        assert kinds[name] == want, name


def _snapshot(model, optimizer):
    return get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _bad_checkpoints(rank: int, world_size: int):
    model, runtime = setup_model(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    train_steps(model, optimizer, rank, world_size, 2)
    model_sd, optim_sd = _snapshot(model, optimizer)
    # The fresh state checkpoints save for a parameter not stepped yet is laid out exactly as
    # the state the optimizer created at its first step.
    for p, state in optimizer.state.items():
        dp = optimizer.dedicated_param(p)
        like = p if dp is None else dp.full
        route = "muon" if "momentum_buffer" in state else "adamw"
        fresh = fresh_state(Route(route), like)
        assert fresh.keys() == state.keys()
        for field, value in state.items():
            assert (type(fresh[field]), fresh[field].shape, fresh[field].dtype) == (
                type(value),
                value.shape,
                value.dtype,
            ), field
            assert fresh[field].device == value.device, field
    # Something different to load, so that a partial write would show.
    other = {k: v + 1.0 if v.is_floating_point() else v for k, v in model_sd.items()}
    proj = next(dp.fqn for dp in runtime.params)
    norm = "layers.0.attn_norm.weight"
    mesh = model.embed_tokens.weight.device_mesh

    bad_models = {
        "missing": ({k: v for k, v in other.items() if k != proj}, f"missing key.*{proj}"),
        "unexpected": (
            {**other, "layers.9.extra": torch.zeros(1)},
            "unexpected key.*layers.9.extra",
        ),
        "shape": ({**other, norm: torch.zeros(3)}, f"{norm}.*shape \\(3,\\)"),
        "shape_dedicated": ({**other, proj: torch.zeros(2, 2)}, f"{proj}.*shape \\(2, 2\\)"),
        # A sharded dictionary (torch's): the embedding, before it in order, was written.
        "dtensor": (
            {**other, proj: distribute_tensor(other[proj], mesh, [Shard(0)])},
            f"{proj}.*is a DTensor",
        ),
    }
    errors = {}
    for label, (sd, match) in bad_models.items():
        with pytest.raises(ValueError, match=match) as info:
            set_model_state_dict(model, sd)
        errors[label] = str(info.value)

    state = optim_sd["state"]
    groups = optim_sd["param_groups"]
    bad_optims = {
        "group_missing": (
            {"state": state, "param_groups": {"muon": groups["muon"]}},
            "missing key.*'adamw'",
        ),
        "state_unexpected": (
            {"state": {**state, "layers.7.q_proj.weight": {}}, "param_groups": groups},
            "unexpected key.*layers.7.q_proj.weight",
        ),
        "field_missing": (
            {"state": {**state, proj: {}}, "param_groups": groups},
            f"missing key.*{proj}.momentum_buffer",
        ),
        "shape": (
            {
                "state": {**state, norm: {**state[norm], "exp_avg": torch.zeros(5)}},
                "param_groups": groups,
            },
            f"{norm}.*'exp_avg'.*shape \\(5,\\)",
        ),
        "dtensor": (
            {
                "state": {
                    **state,
                    norm: {**state[norm], "exp_avg": distribute_tensor(state[norm]["exp_avg"], mesh)},
                },
                "param_groups": groups,
            },
            f"{norm}.*'exp_avg'.*is a DTensor",
        ),
        "top": ({"state": state}, "missing key.*param_groups"),
        "truncated": (
            {"state": {k: v for k, v in state.items() if k != proj}, "param_groups": groups},
            f"no optimizer state for 1 of .*{proj}.*truncated.*strict=False",
        ),
        "dtype": (
            {"state": {**state, proj: {"momentum_buffer": state[proj]["momentum_buffer"].half()}},
             "param_groups": groups},
            f"{proj}.*'momentum_buffer'.*torch.float16.*keeps torch.float32"
            ".*cast the dictionary's tensors to torch.float32",
        ),
    }  # fmt: skip
    for label, (sd, match) in bad_optims.items():
        with pytest.raises(ValueError, match=match) as info:
            set_optimizer_state_dict(model, optimizer, sd)
        errors[label] = str(info.value)
    with pytest.raises(ValueError, match=f"{norm}.*torch.float64.*keeps torch.float32"):
        set_model_state_dict(model, {**other, norm: other[norm].double()})

    # Nothing was modified by any failed call.
    after_model, after_optim = _snapshot(model, optimizer)
    assert _equal(after_model, model_sd)
    assert _equal(after_optim, optim_sd)

    # strict=False accepts the truncated dictionary: that matrix starts from fresh momentum,
    # every other entry is loaded.
    bumped = {k: {f: v + 1 for f, v in entry.items()} for k, entry in state.items() if k != proj}
    set_optimizer_state_dict(
        model, optimizer, {"state": bumped, "param_groups": groups}, strict=False
    )
    loaded = get_optimizer_state_dict(model, optimizer)["state"]
    assert not loaded[proj]["momentum_buffer"].any()
    assert _equal({k: v for k, v in loaded.items() if k != proj}, bumped)
    return errors


@pytest.mark.distributed
def test_bad_checkpoints_raise_before_modifying():
    errors = run_distributed(_bad_checkpoints, 2)[0]
    assert "dmuon.get_model_state_dict" in errors["missing"]


def _same_rank_round_trip(rank: int, world_size: int):
    model, _ = setup_model(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    train_steps(model, optimizer, rank, world_size, 2)
    sd = optimizer.state_dict()
    fresh = Muon(model, **HYPER.muon_kwargs())
    fresh.load_state_dict(sd)
    for p, state in optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(fresh.state[p][key], value)
            assert type(fresh.state[p][key]) is type(value)
    names = [g["group_name"] for g in fresh.param_groups]
    assert names == ["muon", "adamw"]
    # The restored optimizer continues exactly like the original would.
    a = train_steps(model, fresh, rank, world_size, 1, start=2)
    return a


@pytest.mark.distributed
def test_torch_state_dict_round_trip_same_ranks():
    results = run_distributed(_same_rank_round_trip, 2)
    assert results[0] == results[1]


def _all_gather_weight(rank: int, world_size: int):
    """The head as a weight whose class customises FSDP2's all-gather (``AllGatherWeight``,
    torchao's float8 all-gather weight without float8), beside dmuon's matrices, against the
    same run with a plain head."""
    runs = []
    for wrapped in (False, True):
        model = build(0)
        if wrapped:
            wrap_all_gather(model.lm_head, "weight")
        mesh, _, _ = make_mesh(world_size, 1)
        dedicate_params(model, mesh, muon_predicate)
        shard_layers_then_root(model, mesh)
        optimizer = Muon(model, **HYPER.muon_kwargs())
        losses = train_steps(model, optimizer, rank, world_size, 2)
        runs.append((losses, get_model_state_dict(model)))
    return runs


@pytest.mark.distributed
def test_fsdp_weight_with_its_own_all_gather():
    """get_model_state_dict asked whether the all-gathered head aliased its local shard by
    reading the shard's storage, which such a class has none of: RuntimeError 'Attempted to
    access the data pointer on an invalid python storage' on every rank."""
    (plain_losses, plain), (losses, wrapped) = run_distributed(_all_gather_weight, 2)[0]
    assert losses == plain_losses
    assert wrapped.keys() == plain.keys()
    for name, value in wrapped.items():
        assert type(value) is torch.Tensor and torch.equal(value, plain[name]), name


def _hsdp(rank: int, world_size: int):
    model, runtime = setup_model(world_size, replicate=2)
    optimizer, counting = counting_muon(model, HYPER)
    uninterrupted = train_steps(model, optimizer, rank, world_size, TOTAL)
    n_matrices = len(runtime.params)

    model, _ = setup_model(world_size, replicate=2, reshard=False)
    optimizer = Muon(model, **HYPER.muon_kwargs(), options=StepOptions(replicate_async=False))
    first = train_steps(model, optimizer, rank, world_size, SPLIT)
    model_sd, optim_sd = _snapshot(model, optimizer)
    resumed, _ = setup_model(world_size, replicate=2, seed=123)
    resumed_opt = Muon(resumed, **HYPER.muon_kwargs())
    set_model_state_dict(resumed, model_sd)
    set_optimizer_state_dict(resumed, resumed_opt, optim_sd)
    second = train_steps(resumed, resumed_opt, rank, world_size, TOTAL - SPLIT, start=SPLIT)

    # Another topology: a 1-D checkpoint loads into HSDP and reads back unchanged.
    flat, _ = setup_model(world_size)
    flat_opt = Muon(flat, **HYPER.muon_kwargs())
    train_steps(flat, flat_opt, rank, world_size, 2)
    flat_sd = _snapshot(flat, flat_opt)
    hsdp, _ = setup_model(world_size, replicate=2, seed=9)
    hsdp_opt = Muon(hsdp, **HYPER.muon_kwargs())
    set_model_state_dict(hsdp, flat_sd[0])
    set_optimizer_state_dict(hsdp, hsdp_opt, flat_sd[1])
    same = _equal(_snapshot(hsdp, hsdp_opt), flat_sd)
    return uninterrupted, first + second, counting.matrices, n_matrices, same


@pytest.mark.distributed
def test_hsdp_resume_ns_count_and_cross_topology_load():
    results = run_distributed(_hsdp, 4)
    uninterrupted, resumed, _, n_matrices, _ = results[0]
    # Sync publish and Z2 in the split run, async and Z3 uninterrupted: all bit-identical.
    assert resumed == uninterrupted
    assert uninterrupted[-1] < uninterrupted[0]
    # NS once per matrix per step across the whole world, never once per replica.
    assert sum(r[2] for r in results) == n_matrices * TOTAL
    assert all(r[4] for r in results)


class _Transients(StoragePeak):
    """``StoragePeak`` that also records the largest single storage the ops create."""

    def __init__(self, baseline: set[int]) -> None:
        super().__init__(baseline)
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (storage := storage_of(t)) is not None:
                if storage.data_ptr() not in self.baseline:
                    self.largest = max(self.largest, storage.nbytes())
        return out


def _rank0_only(rank: int, world_size: int):
    model, _ = setup_model(world_size, small_param_threshold=0)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    train_steps(model, optimizer, rank, world_size, 2)
    everywhere = _snapshot(model, optimizer)
    mode = _Transients(set(live_storages()))
    with mode:
        got = (
            get_model_state_dict(model, rank0_only=True),
            get_optimizer_state_dict(model, optimizer, rank0_only=True),
        )
    largest_param = max(v.numel() * v.element_size() for v in everywhere[0].values())
    cpu = all(v.device.type == "cpu" for v in got[0].values())
    return (
        got if rank == 0 else got == ({}, {}),
        everywhere,
        mode.largest,
        mode.peak,
        largest_param,
        cpu,
        _torch_options(model, optimizer, got, everywhere),
    )


def _torch_options(model, optimizer, rank0_only, everywhere) -> list[str]:
    """torch's ``StateDictOptions`` passed as a script moved from torch passes them (see
    [Note: torch's options]): what they return and load, and the refusals, which raise before
    any collective. Returns what went wrong on this rank."""
    wrong = []
    full = StateDictOptions(full_state_dict=True)
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # torch: cpu_offload with full_state_dict is rank 0's dictionary alone, on the CPU.
    if not _equal(
        (
            get_model_state_dict(model, options=offload),
            get_optimizer_state_dict(model, optimizer, options=offload),
        ),
        rank0_only,
    ):
        wrong.append("cpu_offload is not rank 0 alone")
    if not _equal(
        (
            get_model_state_dict(model, options=full),
            get_optimizer_state_dict(model, optimizer, options=full),
        ),
        everywhere,
    ):
        wrong.append("full_state_dict is not every rank's dictionary")
    # Loaded back from rank 0's dictionary (broadcast) and from every rank's, nothing moves.
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, rank0_only[0] or {}, options=broadcast)
    set_optimizer_state_dict(model, optimizer, everywhere[1], options=full)
    if not _equal(_snapshot(model, optimizer), everywhere):
        wrong.append("the loads changed the state")
    refused = [
        (ValueError, "sharded", lambda: get_model_state_dict(model, options=StateDictOptions())),
        (TypeError, "not both", lambda: get_model_state_dict(model, rank0_only=True, options=full)),
        (
            ValueError,
            "every key of the model or none",
            lambda: set_model_state_dict(
                model, everywhere[0], options=StateDictOptions(full_state_dict=True, strict=False)
            ),
        ),
        (
            ValueError,
            "flatten_optimizer_state_dict",
            lambda: get_optimizer_state_dict(
                model,
                optimizer,
                options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
            ),
        ),
    ]
    for error, phrase, call in refused:
        try:
            call()
            wrong.append(f"no {error.__name__} ({phrase})")
        except error as exc:
            if phrase not in str(exc):
                wrong.append(f"{phrase!r} not in {exc}")
    return wrong


@pytest.mark.distributed
def test_rank0_only_holds_one_full_tensor_at_a_time():
    results = run_distributed(_rank0_only, 4)
    got, everywhere, *_ = results[0]
    assert _equal(got, everywhere), "rank 0's dictionaries differ from the gathered-everywhere ones"
    assert all(r[0] is True for r in results[1:]), "ranks 1-3 must get {} and {}"
    for rank, (_, _, largest, peak, largest_param, cpu, options_wrong) in enumerate(results):
        assert cpu
        assert options_wrong == [], (rank, options_wrong)
        # No tensor larger than one full parameter was ever made, and on ranks 1-3 (which keep
        # nothing) the transients alive at once never exceeded one full parameter.
        assert 0 < largest <= largest_param, (rank, largest, largest_param)
        if rank > 0:
            assert peak <= largest_param, (rank, peak, largest_param)
