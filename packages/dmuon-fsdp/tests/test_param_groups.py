"""Semantic param groups: the split into ``<name>/muon`` and ``<name>/adamw``, overrides, route
forcing, schedulers, and the construction errors for stale / duplicate / missing params."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from _models import build, muon_predicate, shard_layers_then_root
from _reference import Hyper, lm_loss, make_batch, shard, train_reference
from test_training import ROWS, SEQ, VOCAB, setup_model, train_steps
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from dmuon_fsdp import (
    Muon,
    StepOptions,
    collect_forward_unshard_profile,
    dedicate_params,
    dedicated_params_of,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_runtime,
    set_optimizer_state_dict,
    summarize_comm_plan,
    summarize_param_groups,
)
from dmuon_fsdp.optim._param_groups import check_no_inert_keys
from dmuon_ns import NewtonSchulz
from dmuon_ownership import Route
from dmuon_testing.distributed import run_distributed
from dmuon_testing.typed_dicts import check_returns

HYPER = Hyper()


def _split(model):
    head, body = [], []
    for name, p in model.named_parameters():
        (head if name.startswith(("lm_head", "norm", "layers.1")) else body).append(p)
    return body, head


def _semantic_equals_default(rank: int, world_size: int):
    model, _ = setup_model(world_size)
    default = train_steps(model, Muon(model, **HYPER.muon_kwargs()), rank, world_size, 3)
    model, _ = setup_model(world_size)
    body, head = _split(model)
    groups = [{"params": body, "group_name": "body"}, {"params": head, "group_name": "head"}]
    optimizer = Muon(model, **HYPER.muon_kwargs(), param_groups=groups)
    names = [g["group_name"] for g in optimizer.param_groups]
    semantic = train_steps(model, optimizer, rank, world_size, 3)
    return default, semantic, names


@pytest.mark.distributed
def test_semantic_groups_with_default_values_equal_default_groups():
    default, semantic, names = run_distributed(_semantic_equals_default, 2)[0]
    assert names == ["body/muon", "body/adamw", "head/muon", "head/adamw"]
    assert semantic == default


def _overrides_and_scheduler(rank: int, world_size: int):
    model, runtime = setup_model(world_size)
    body, head = _split(model)
    groups = [
        {"params": body, "group_name": "body", "lr": 0.5, "adamw_lr": 0.25, "momentum": 0.8},
        {
            "params": head,
            "group_name": "head",
            "muon_weight_decay": 0.3,
            "adamw_betas": (0.5, 0.6),
            "adamw_eps": 1e-5,
        },
    ]
    optimizer = Muon(model, lr=0.01, adamw_lr=0.002, param_groups=groups)
    by_name = {g["group_name"]: g for g in optimizer.param_groups}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    train_steps(model, optimizer, rank, world_size, 2, scheduler=scheduler)
    summary = summarize_param_groups(model, optimizer)
    plan = summarize_comm_plan(model)
    profile = collect_forward_unshard_profile(model)
    json.dumps([summary, plan, profile])  # JSON-friendly
    return (
        {name: {k: v for k, v in g.items() if k not in ("params",)} for name, g in by_name.items()},
        summary,
        plan,
        profile,
        sorted(dp.fqn for dp in runtime.owned),
    )


@pytest.mark.distributed
def test_overrides_scheduler_and_diagnostics():
    results = run_distributed(_overrides_and_scheduler, 2)
    groups, summary, plan, profile, _ = results[0]
    # User groups and a scheduler's initial_lr: still of the declared types.
    check_returns(summarize_param_groups, summary)
    check_returns(summarize_comm_plan, plan)
    check_returns(collect_forward_unshard_profile, profile)
    body_muon, body_adamw = groups["body/muon"], groups["body/adamw"]
    head_muon, head_adamw = groups["head/muon"], groups["head/adamw"]
    # lr applies to both subgroups unless overridden; the scheduler scaled each by 0.25.
    assert body_muon["lr"] == pytest.approx(0.5 * 0.25)
    assert body_adamw["lr"] == pytest.approx(0.25 * 0.25)
    assert head_muon["lr"] == pytest.approx(0.01 * 0.25)
    assert head_adamw["lr"] == pytest.approx(0.002 * 0.25)
    assert body_muon["initial_lr"] == 0.5 and head_adamw["initial_lr"] == 0.002
    assert body_muon["momentum"] == 0.8 and head_muon["momentum"] == 0.95
    assert head_muon["weight_decay"] == 0.3 and body_muon["weight_decay"] == 0.0
    assert head_adamw["betas"] == (0.5, 0.6) and head_adamw["eps"] == 1e-5
    assert body_adamw["betas"] == (0.9, 0.999) and body_adamw["weight_decay"] == 0.01
    assert all(n.startswith(("lm_head", "norm", "layers.1")) for n in head_muon["param_names"])
    assert "layers.1.attn.q_proj.weight" in head_muon["param_names"]
    assert "layers.0.mlp.up_proj.weight" in body_muon["param_names"]
    assert "embed_tokens.weight" in body_adamw["param_names"]

    # Diagnostics: every rank steps its own share; together they cover every parameter once.
    stepped = [
        n for r in results for g in r[1] if g["optimizer"] == "muon" for n in g["stepped_here"]
    ]
    model = build(0)
    muon_names = sorted(n for n, p in model.named_parameters() if muon_predicate(n, p))
    assert sorted(stepped) == muon_names
    assert sorted(n for r in results for n in r[4]) == muon_names
    assert {s["name"]: s["hyperparameters"]["lr"] for s in summary}["body/muon"] == pytest.approx(
        0.125
    )
    assert plan["world_size"] == 2 and plan["num_params"] == len(muon_names)
    assert sum(len(p["params"]) for b in plan["boundaries"] for p in b["packs"]) == len(muon_names)
    muon_bytes = 4 * sum(p.numel() for n, p in model.named_parameters() if muon_predicate(n, p))
    assert plan["payload_bytes_per_step"] == {
        "shard/broadcast": 2 * muon_bytes,
        "shard/reduce": muon_bytes + 4 * len(muon_names),  # and a presence flag per matrix
    }
    assert [b["name"] for b in profile["boundaries"]] == ["layers.0", "layers.1"]
    for r in results:
        received = sum(b["recv_bytes_per_broadcast"] for b in r[3]["boundaries"])
        sent = sum(b["send_bytes_per_broadcast"] for b in r[3]["boundaries"])
        assert received + sent == muon_bytes


def _schedule(groups: int, steps: int) -> list[tuple[list[float], float]]:
    """Each step's (lr of every group, momentum) under OneCycleLR, from torch's own scheduler
    on an SGD optimizer with momentum."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
    sgd = torch.optim.SGD([{"params": [p]} for p in params], lr=0.01, momentum=0.9)
    cycle = torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.04, total_steps=steps + 1)
    values = []
    for _ in range(steps):
        values.append(([g["lr"] for g in sgd.param_groups], sgd.param_groups[0]["momentum"]))
        sgd.step()
        cycle.step()
    return values


def _group_edits(rank: int, world_size: int):
    """The same hyperparameters reach the step however they are set: written in place, as
    replaced group dicts (a tensor lr among them), or by OneCycleLR (its momentum cycles AdamW's
    beta1 too); a tensor lr saves and loads."""
    steps = 3
    schedule = _schedule(2, steps)
    runs = {}
    for how in ("in_place", "replaced", "one_cycle"):
        model, _ = setup_model(world_size)
        optimizer = Muon(model, lr=0.01, adamw_lr=0.01)
        cycle = None
        if how == "one_cycle":
            cycle = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=0.04, total_steps=steps + 1
            )
        for step, (lrs, momentum) in enumerate(schedule):
            if how == "in_place":
                for group, lr in zip(optimizer.param_groups, lrs):
                    group["lr"] = lr
                    if group["optimizer"] == "muon":
                        group["momentum"] = momentum
                    else:
                        group["betas"] = (momentum, group["betas"][1])
            elif how == "replaced":
                for i, (group, lr) in enumerate(zip(optimizer.param_groups, lrs)):
                    key = "momentum" if group["optimizer"] == "muon" else "betas"
                    value = momentum if key == "momentum" else (momentum, group["betas"][1])
                    optimizer.param_groups[i] = {
                        **group,
                        "lr": torch.tensor(lr, dtype=torch.float64),
                        key: value,
                    }
            train_steps(model, optimizer, rank, world_size, 1, start=step, scheduler=cycle)
        runs[how] = {k: v.clone() for k, v in get_model_state_dict(model).items()}
    # OneCycleLR's momentum of the last step is AdamW's beta1 now (its next step's value waits
    # under "momentum" for the next step); a tensor lr saves and loads.
    betas = [g["betas"] for g in optimizer.param_groups if g["optimizer"] == "adamw"]
    optimizer.param_groups[0]["lr"] = torch.tensor(0.01, dtype=torch.float64)
    set_optimizer_state_dict(model, optimizer, get_optimizer_state_dict(model, optimizer))
    # A replacement that is not the same group, or a value out of range written in place, is
    # refused before the step changes anything.
    first, second = optimizer.param_groups[0], optimizer.param_groups[1]
    edits = [
        (0, {**first, "params": second["params"]}),
        (0, {"params": first["params"]}),
        (0, {"lr": float("nan")}),
        (0, {"momentum": 1.5}),
        (1, {"lr": -0.01}),
        (1, {"betas": (0.9, 1.0)}),
        # torch.optim.Muon's per-group keys, and a user group's, mean nothing to a step.
        (0, {"ns_steps": 3}),
        (1, {"adamw_lr": 0.1}),
        # ... in a replacement too, refused before it replaces anything.
        (0, {**first, "lr": 0.5, "ns_steps": 3}),
        # torch.optim.AdamW's flags that change its arithmetic, which dmuon's AdamW lacks.
        (1, {"maximize": True}),
        # ... and those that choose its kernel: dmuon's AdamW always runs the fused one (they
        # were taken and changed nothing).
        (1, {"foreach": True, "fused": False}),
        # A misspelt key, and the other optimizer's key (a loop over every group reaches
        # both kinds), which torch's optimizers would take without a word.
        (0, {"weight_decy": 0.1}),
        (1, {"learning_rate": 0.1}),
        (0, {"betas": (0.5, 0.999)}),
        (1, {"nesterov": False}),
    ]
    errors = []
    for index, edit in edits:
        group = optimizer.param_groups[index]
        kept = dict(group)
        if "params" in edit:
            optimizer.param_groups[index] = edit
        else:
            group.update(edit)
        before = {k: v.clone() for k, v in get_model_state_dict(model).items()}
        with pytest.raises(ValueError) as info:
            train_steps(model, optimizer, rank, world_size, 1, start=steps)
        errors.append(str(info.value))
        after = get_model_state_dict(model)
        assert all(torch.equal(after[k], v) for k, v in before.items())
        if "params" in edit:  # a refused replacement left the group as it was
            assert group.keys() == kept.keys() and all(group[k] is kept[k] for k in kept)
        group.clear()
        group.update(kept)
        optimizer.param_groups[index] = group
    # A loaded group with such a key would make every step raise: refused at the load, which
    # loads nothing.
    full = get_optimizer_state_dict(model, optimizer)
    own = optimizer.state_dict()
    full["param_groups"]["muon"]["ns_steps"] = 3
    own["param_groups"][1]["adamw_lr"] = 0.1
    kept_groups = [dict(g) for g in optimizer.param_groups]
    for load in (
        lambda: set_optimizer_state_dict(model, optimizer, full),
        lambda: optimizer.load_state_dict(own),
    ):
        with pytest.raises(ValueError) as info:
            load()
        errors.append(str(info.value))
        assert optimizer.param_groups == kept_groups
        _assert_same_state(get_optimizer_state_dict(model, optimizer), full, skip="ns_steps")
    return runs, betas, schedule[-1][1], errors


def _assert_same_state(got, want, skip):
    """``got`` and ``want`` (full optimizer state dicts) hold equal tensors and group values
    (bit for bit), but for the group key ``skip``."""
    assert got["state"].keys() == want["state"].keys()
    for fqn, fields in want["state"].items():
        for field, value in fields.items():
            assert torch.equal(got["state"][fqn][field], value), (fqn, field)
    for name, group in want["param_groups"].items():
        assert {k: v for k, v in got["param_groups"][name].items() if k != skip} == {
            k: v for k, v in group.items() if k != skip
        }, name


def test_eps_in_a_muon_group_names_adamw_and_torch_muons_meaning():
    """A loop that writes "eps" into every group reaches the Muon ones, where it is either
    AdamW's (write it into the AdamW groups) or torch.optim.Muon's per-group NS eps, a floor
    dmuon has no key for: the refusal names both."""
    with pytest.raises(ValueError) as info:
        check_no_inert_keys({"lr": 0.02, "eps": 1e-3}, "group 'muon'", Route.MUON)
    assert "write it into the '.../adamw' groups only" in str(info.value)
    assert "torch.optim.Muon's eps is a floor on the norm" in str(info.value)
    with pytest.raises(ValueError, match=r"coefficients=\[\(a, b, c\)\]"):
        check_no_inert_keys({"ns_coefficients": (3.4, -4.7, 2.0)}, "group 'muon'", Route.MUON)


@pytest.mark.distributed
def test_group_edits_reach_the_step():
    results = run_distributed(_group_edits, 2)
    for runs, betas, momentum, errors in results:
        assert "replaced by a dict that holds other parameters" in errors[0]
        assert (
            "replaced by a dict without ['group_name', 'param_names', 'optimizer', 'lr'"
            in errors[1]
        )
        assert "group 'muon': lr must be a finite number" in errors[2]
        assert "group 'muon': momentum must lie in [0, 1)" in errors[3]
        assert "group 'adamw': lr must be >= 0.0" in errors[4]
        assert "group 'adamw': adamw_betas[1] must lie in [0, 1)" in errors[5]
        assert "group 'muon' holds ['ns_steps'], which no step reads" in errors[6]
        assert "group 'adamw' holds ['adamw_lr'], which no step reads" in errors[7]
        assert "group 'muon' holds ['ns_steps'], which no step reads" in errors[8]
        assert "group 'adamw' holds ['maximize'], which no step reads" in errors[9]
        assert "group 'adamw' holds ['foreach', 'fused'], which no step reads" in errors[10]
        assert "torch's fused AdamW kernel" in errors[10]
        assert (
            "group 'muon' holds ['weight_decy'], which no step reads (the step would go on"
            " without them): weight_decy is 'weight_decay' misspelt: set group['weight_decay']"
            " instead" in errors[11]
        )
        assert "learning_rate is 'lr' misspelt: set group['lr'] instead" in errors[12]
        assert (
            "group 'muon' holds ['betas'], which no step reads (the step would go on without"
            " them): betas is adamw's, and this group steps with 'muon': write it into the"
            " '.../adamw' groups only (if group['optimizer'] == 'adamw')" in errors[13]
        )
        assert "group 'adamw' holds ['nesterov'], which no step reads" in errors[14]
        assert "set_optimizer_state_dict: param_groups['muon'] holds ['ns_steps']" in errors[15]
        assert "load_state_dict: param group 'adamw' holds ['adamw_lr']" in errors[16]
        for name, value in runs["in_place"].items():
            assert torch.equal(runs["replaced"][name], value), name
            assert torch.equal(runs["one_cycle"][name], value), name
        assert betas == [(momentum, 0.999)]
    assert results[0][0]["in_place"].keys() == results[1][0]["in_place"].keys()


def _params_edited(rank: int, world_size: int) -> list[str]:
    """A group's ``"params"`` edited in place, as a torch optimizer's would be to stop stepping
    a parameter (or to step another): the step plan would go on stepping what Muon was built
    with. Each edit is refused at the next step before anything changes (so are the other keys
    the plan does not follow); with the list put back, training goes on."""
    model, _ = setup_model(world_size)
    optimizer = Muon(model, lr=0.02, adamw_lr=0.01)
    train_steps(model, optimizer, rank, world_size, 1)
    muon, adamw = optimizer.param_groups
    edits = [
        (muon, lambda params: params.pop()),  # a matrix removed in place
        (adamw, lambda params: params.insert(0, torch.nn.Parameter(torch.zeros(2)))),
    ]
    errors = []
    for group, edit in edits:
        kept = list(group["params"])
        edit(group["params"])
        before = {k: v.clone() for k, v in get_model_state_dict(model).items()}
        with pytest.raises(ValueError) as info:
            train_steps(model, optimizer, rank, world_size, 1, start=1)
        errors.append(str(info.value))
        after = get_model_state_dict(model)
        assert all(torch.equal(after[k], v) for k, v in before.items())
        group["params"][:] = kept
    # The key assigned a shorter list; the other keys the step plan does not follow: the
    # names a checkpoint saves the states under, the optimizer, a hyperparameter deleted.
    for key, value in [
        ("params", muon["params"][1:]),
        ("param_names", muon["param_names"][:-1]),
        ("optimizer", "adamw"),
        ("momentum", None),
    ]:
        kept = muon[key]
        if value is None:
            del muon[key]
        else:
            muon[key] = value
        with pytest.raises(ValueError) as info:
            train_steps(model, optimizer, rank, world_size, 1, start=1)
        errors.append(str(info.value))
        muon[key] = kept
    # ... and a replacement whose names are not the group's.
    optimizer.param_groups[0] = {**muon, "param_names": muon["param_names"][::-1]}
    with pytest.raises(ValueError) as info:
        train_steps(model, optimizer, rank, world_size, 1, start=1)
    errors.append(str(info.value))
    optimizer.param_groups[0] = muon
    train_steps(model, optimizer, rank, world_size, 1, start=1)
    return errors


@pytest.mark.distributed
def test_a_groups_params_and_fixed_keys_edited_in_place_are_refused():
    for errors in run_distributed(_params_edited, 2):
        assert (
            "group 'muon': its 'params' list was changed since Muon was built (without"
            " ['layers.1.mlp.down_proj.weight'])" in errors[0]
        ), errors[0]
        assert "p.requires_grad_(False)" in errors[0]
        assert "group 'adamw': its 'params' list was changed" in errors[1]
        assert "(with 1 tensor(s) it was not built with)" in errors[1]
        assert "(without ['layers.0.attn.q_proj.weight'])" in errors[2], errors[2]
        assert "group 'muon': its 'param_names' were changed" in errors[3], errors[3]
        assert "its 'optimizer' was changed to 'adamw': a group's optimizer is fixed" in errors[4]
        assert "group 'muon' lacks ['momentum'], deleted since Muon was built" in errors[5]
        assert "replaced by a dict whose 'param_names' were changed" in errors[6]


def _one_lr_tensor(rank: int, world_size: int):
    """One user group's lr as a float and as a tensor, under a scheduler with a factor per
    optimizer group (the tuning guide's LambdaLR([f_muon, f_adamw]))."""
    out = {}
    for kind in ("float", "tensor", "tensor, NS during backward"):
        model, _ = setup_model(world_size)
        lr = 0.02 if kind == "float" else torch.tensor(0.02, dtype=torch.float64)
        groups = [{"params": list(model.parameters()), "group_name": "all", "lr": lr}]
        options = StepOptions(ns_overlap=kind.endswith("backward"))
        optimizer = Muon(model, param_groups=groups, options=options)
        factors = {"muon": lambda step: 0.5**step, "adamw": lambda step: 0.1}
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, [factors[g["optimizer"]] for g in optimizer.param_groups]
        )
        # The step reads each group's lr once, not once per matrix it steps.
        lr_storage = {g["lr"].data_ptr() for g in optimizer.param_groups if kind != "float"}
        reads: list[bool] = []

        def counted(t, reads=reads, lr_storage=lr_storage, to_float=torch.Tensor.__float__):
            reads.append(t.data_ptr() in lr_storage)
            return to_float(t)

        with mock.patch.object(torch.Tensor, "__float__", counted):
            train_steps(model, optimizer, rank, world_size, 3, scheduler=scheduler)
        lrs = {g["group_name"]: float(g["lr"]) for g in optimizer.param_groups}
        early = optimizer._overlap.used if optimizer._overlap is not None else 0
        out[kind] = (lrs, get_model_state_dict(model), sum(reads), early)
    return out


def _lr_set_by_a_pre_step_hook(rank: int, world_size: int) -> list[str]:
    """The weights a step moved whose pre-step hook set every group's lr to 0 in place."""
    model, _ = setup_model(world_size)
    optimizer = Muon(model, lr=0.02, weight_decay=0.1)
    train_steps(model, optimizer, rank, world_size, 1)

    def stop(optimizer: Muon) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 0.0

    optimizer.register_pre_step_hook(stop)
    before = get_model_state_dict(model)
    train_steps(model, optimizer, rank, world_size, 1, start=1)
    after = get_model_state_dict(model)
    return [name for name, value in before.items() if not torch.equal(after[name], value)]


@pytest.mark.distributed
def test_a_pre_step_hook_sets_the_lr_of_its_own_step():
    assert run_distributed(_lr_set_by_a_pre_step_hook, 2) == [[], []]


@pytest.mark.distributed
def test_a_tensor_lr_is_each_groups_own_under_a_scheduler():
    results = run_distributed(_one_lr_tensor, 2)
    for result in results:
        (float_lrs, float_weights, *_), *tensor_runs = result.values()
        (_, _, reads, _), (_, _, overlap_reads, _) = tensor_runs
        assert reads == 3 * 2  # steps × groups
        # NS during backward reads no lr (its early half uses momentum and Nesterov only).
        assert overlap_reads == 3 * 2
        for lrs, weights, *_ in tensor_runs:
            assert lrs == float_lrs == {"all/muon": 0.02 * 0.5**3, "all/adamw": 0.02 * 0.1}
            for name, value in float_weights.items():
                assert torch.equal(weights[name], value), name
    assert any(result["tensor, NS during backward"][3] for result in results)


def _forced_route(rank: int, world_size: int):
    model, _ = setup_model(world_size)
    body, head = _split(model)
    groups = [
        {"params": body, "group_name": "body"},
        {"params": head, "group_name": "head", "dmuon_route": "adamw"},
    ]
    optimizer = Muon(model, **HYPER.muon_kwargs(), param_groups=groups)
    head_muon = next(g for g in optimizer.param_groups if g["group_name"] == "head/muon")
    losses = train_steps(model, optimizer, rank, world_size, 4)
    ref = None
    if rank == 0:
        plain = build(0)
        muon = [
            n
            for n, p in plain.named_parameters()
            if muon_predicate(n, p) and not n.startswith("layers.1")
        ]
        ref = train_reference(plain, muon, HYPER, 4, ROWS, SEQ, VOCAB)
    return len(head_muon["params"]), losses, ref


@pytest.mark.distributed
def test_forced_adamw_route_matches_reference():
    n_head_muon, losses, ref = run_distributed(_forced_route, 2)[0]
    assert n_head_muon == 0
    assert losses == pytest.approx(ref, rel=2e-3)


def _errors(rank: int, world_size: int):
    # Stale: groups built before fully_shard hold the pre-wrapping parameters.
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, muon_predicate)
    stale = [p for n, p in model.named_parameters() if n == "layers.0.attn_norm.weight"]
    shard_layers_then_root(model, mesh)
    current = [p for n, p in model.named_parameters() if n != "layers.0.attn_norm.weight"]
    messages = {}
    cases = {
        "stale": (
            [{"params": current + stale, "group_name": "all"}],
            "not a parameter of the wrapped model.*layers.0.attn_norm.weight.*after"
            " dedicate_params\\(\\) and fully_shard\\(\\)",
        ),
        "duplicate": (
            [
                {"params": current, "group_name": "a"},
                {"params": current[:1], "group_name": "b"},
            ],
            "'embed_tokens.weight' is also in param_groups\\[0\\] \\('a'\\).*exactly one group",
        ),
        "missing": (
            [{"params": current, "group_name": "a"}],
            "missing trainable parameter.*'layers.0.attn_norm.weight'.*add them to a group",
        ),
        "unknown_key": (
            [{"params": current, "group_name": "a", "betas": (0.9, 0.9)}],
            "unknown key.*'betas'",
        ),
        "bad_route": (
            [{"params": current, "dmuon_route": "sgd"}],
            "dmuon_route='sgd'.*use 'muon' or 'adamw'",
        ),
    }
    for label, (groups, match) in cases.items():
        with pytest.raises(ValueError, match=match) as info:
            Muon(model, param_groups=groups)
        messages[label] = str(info.value)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        Muon(model, lr=-1.0)
    # A string would be truthy: "no" must not turn Nesterov on.
    with pytest.raises(TypeError, match="Muon: nesterov must be a bool, got 'no'"):
        Muon(model, nesterov="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"param_groups\[0\]: nesterov must be a bool"):
        Muon(model, param_groups=[{"params": list(model.parameters()), "nesterov": "no"}])
    with pytest.raises(ValueError, match="lr_scaling"):
        Muon(model, options=StepOptions(lr_scaling="sqrt"))
    with pytest.raises(ValueError, match=r"an nn\.Module"):
        Muon(list(model.parameters()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ns_batch_bytes must be a positive int"):
        Muon(model, options=StepOptions(ns_batch_bytes=0))
    with pytest.raises(ValueError, match="ns_backend must be 'gram', 'direct'"):
        Muon(model, ns_backend="svd")
    with pytest.raises(ValueError, match=r"exclude each other.*choose one"):
        StepOptions(ns_overlap=True, cuda_graph=True)
    with pytest.raises(ValueError, match=r"cuda_graph=True\) needs CUDA.*on cpu"):
        Muon(model, options=StepOptions(cuda_graph=True, profile=True))
    assert get_runtime(model).hooks.wait_timers is None, "a failed Muon() left forward timing on"
    with pytest.raises(ValueError, match=r"Newton–Schulz is a callable.*cannot capture"):
        Muon(model, ns_backend=lambda x: x, options=StepOptions(cuda_graph=True))
    custom = NewtonSchulz(backend="direct", steps=3)
    assert Muon(model, ns_backend=custom).newton_schulz is custom
    seven = Muon(model, ns_backend="direct", ns_steps=7, momentum=0.9)
    assert seven.newton_schulz.steps == 7
    assert seven.defaults == {
        "lr": 0.02,
        "weight_decay": 0.0,
        "momentum": 0.9,
        "nesterov": True,
        "adamw_lr": 1e-3,
        "adamw_betas": (0.9, 0.999),
        "adamw_eps": 1e-8,
        "adamw_weight_decay": 0.01,
        "ns_steps": 7,
    }
    optimizer = Muon(model)
    with pytest.raises(ValueError, match=r"Muon\(model, param_groups=\[\.\.\.\]\)"):
        optimizer.add_param_group({"params": []})
    # Lightning's BaseFinetuning habit: unfreeze a layer, then add its parameters. The message
    # names them and the fix; nothing changes.
    head = [model.get_parameter("lm_head.weight"), torch.zeros(2)]
    with pytest.raises(
        ValueError,
        match=r"cannot add the model's parameters \['lm_head\.weight'\] and 1 tensor\(s\) that"
        r" are not parameters of the model\. .*trainable at dedicate_params and Muon\(model\)",
    ):
        optimizer.add_param_group({"params": head, "lr": 0.1})
    assert len(optimizer.param_groups) == 2
    with pytest.raises(AttributeError):  # fixed at construction: the plan and hooks read it
        optimizer.options = StepOptions(skip_nonfinite=False)  # type: ignore[misc]

    # Wrong call order: before fully_shard, the model's other parameters are unsynchronised.
    early = build(0)
    dedicate_params(early, mesh, muon_predicate)
    with pytest.raises(ValueError, match=r"built before fully_shard.*-> Muon\(model\)"):
        Muon(early)
    return messages


def _too_early_on_one_rank(rank: int, world_size: int) -> None:
    # On one rank nothing needs synchronising, but an optimizer built before fully_shard holds
    # the parameters FSDP2 then replaced: the first step says so.
    mesh = init_device_mesh("cpu", (world_size,))
    early = build(0)
    dedicate_params(early, mesh, muon_predicate)
    too_early = Muon(early)
    shard_layers_then_root(early, mesh)
    with pytest.raises(ValueError, match=r"built before fully_shard.*-> Muon\(model\)"):
        too_early.step()


def _unsharded_at_step(rank: int, world_size: int) -> None:
    # Z2 keeps a module's gathered weights after a forward: one run after backward (an
    # evaluation) leaves FSDP2 holding them at step(), and stepping the shards would not reach
    # the next forward. Every step says so (the first one not "built before fully_shard").
    mesh = init_device_mesh("cpu", (world_size,))
    model = build(0)
    dedicate_params(model, mesh, muon_predicate, reshard_after_forward=False)
    dedicated = dedicated_params_of(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=dedicated, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, ignored_params=dedicated, reshard_after_forward=False)
    batch = shard(make_batch(0, ROWS, SEQ, VOCAB), rank, world_size)
    # The same before Muon is built (an evaluation first): it said the root's parameters were
    # "neither dedicated nor managed by FSDP2" and to apply fully_shard, which was done.
    with torch.no_grad():
        lm_loss(model, batch)
    with pytest.raises(ValueError, match=r"FSDP2 holds '.*' unsharded while the optimizer is b"):
        Muon(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    optimizer = Muon(model)
    for _ in range(2):  # the first step, then a later one
        lm_loss(model, batch).backward()
        with torch.no_grad():
            lm_loss(model, batch)
        with pytest.raises(ValueError, match=r"FSDP2 holds '.*' unsharded.*call \.reshard\(\)"):
            optimizer.step()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        optimizer.step()
        optimizer.zero_grad()
    # An evaluation and no backward since the last step, as on a rank whose data ran out
    # first at the end of an uneven epoch while the others wait in their backward: the
    # .reshard() named above would hang it too, and the message says what happened instead.
    with torch.no_grad():
        lm_loss(model, batch)
    with pytest.raises(ValueError, match=r"no backward ran on this rank.*drop_last=True"):
        optimizer.step()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    optimizer.step()  # every rank steps without a backward


@pytest.mark.distributed
def test_bad_param_groups_raise_at_construction():
    run_distributed(_errors, 2)
    run_distributed(_too_early_on_one_rank, 1)
    run_distributed(_unsharded_at_step, 2)


def _policy_routes(rank: int, world_size: int):
    # Type-split routing: every layer parameter is dedicated; projections take Muon, the
    # norms ride dmuon's owner broadcast/reduce with AdamW on their owner.
    model = build(0)
    mesh = init_device_mesh("cpu", (world_size,))
    runtime = dedicate_params(
        model,
        mesh,
        lambda n, p: n.startswith("layers."),
        param_policy={
            "defaults": {"route": "adamw"},
            "overrides": [{"name": ["*proj"], "set": {"route": "muon"}}],
        },
    )
    shard_layers_then_root(model, mesh)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    adamw_dedicated = sorted(dp.fqn for dp in runtime.params if dp.route == "adamw")
    muon_group = next(g for g in optimizer.param_groups if g["group_name"] == "muon")
    losses = train_steps(model, optimizer, rank, world_size, 4)
    owned_with_adam_state = sorted(
        dp.fqn for dp in runtime.owned if dp.route == "adamw" and optimizer.state[dp.param]
    )
    # Dedicated AdamW state (moments and step from the owner) survives a checkpoint round trip.
    optim_sd = get_optimizer_state_dict(model, optimizer)
    fresh = Muon(model, **HYPER.muon_kwargs())
    set_optimizer_state_dict(model, fresh, optim_sd)
    again = get_optimizer_state_dict(model, fresh)
    norm = optim_sd["state"]["layers.1.mlp_norm.weight"]
    assert sorted(norm) == ["exp_avg", "exp_avg_sq", "step"] and float(norm["step"]) == 4.0
    for fqn, entry in optim_sd["state"].items():
        for key, value in entry.items():
            assert torch.equal(again["state"][fqn][key], value), (fqn, key)
    ref = None
    if rank == 0:
        plain = build(0)
        muon = [n for n, p in plain.named_parameters() if muon_predicate(n, p)]
        ref = train_reference(plain, muon, HYPER, 4, ROWS, SEQ, VOCAB)
    return losses, ref, adamw_dedicated, sorted(muon_group["param_names"]), owned_with_adam_state


@pytest.mark.distributed
def test_policy_adamw_route_steps_on_owner_and_matches_reference():
    results = run_distributed(_policy_routes, 2)
    losses, ref, adamw_dedicated, muon_names, _ = results[0]
    assert "layers.0.attn_norm.weight" in adamw_dedicated
    assert all("proj" in n for n in muon_names) and len(muon_names) == 14
    # Each dedicated AdamW parameter has Adam state on exactly one rank: its owner.
    stepped = sorted(n for r in results for n in r[4])
    assert stepped == adamw_dedicated
    assert losses == pytest.approx(ref, rel=2e-3)


class _Twins(torch.nn.Module):
    """A Hugging Face ``Conv1D`` (weight stored ``(in, out)``, as GPT-2's ``c_attn``) and a
    Linear whose weight is its transpose, summed."""

    def __init__(self) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.conv = Conv1D(96, 32)  # in 32, out 96
        self.conv.bias.requires_grad_(False)  # zeros, as the Linear has none
        self.linear = torch.nn.Linear(32, 96, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(self.conv.weight.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + self.linear(x)


def _conv1d_and_linear_after_a_step(rank: int, world_size: int, scaling: str) -> float:
    """Each layer holds a Hugging Face ``Conv1D`` (weight stored ``(in, out)``) and a Linear
    whose weight is its transpose, fed the same input: their gradients, momenta and NS
    results are transposes of each other, so their steps are too when the lr scale reads the
    Conv1D weight as ``(out, in)``. Returns the largest difference after a step."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(_Twins() for _ in range(2))
    mesh = init_device_mesh("cpu", (world_size,))
    dedicate_params(model, mesh, lambda n, p: n.endswith("weight"), small_param_threshold=0)
    optimizer = Muon(model, lr=0.1, weight_decay=0.0, options=StepOptions(lr_scaling=scaling))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))  # full rank
    loss = sum(layer(x).square().sum() for layer in model.layers)
    loss.backward()
    optimizer.step()
    weights = get_model_state_dict(model)
    return max(
        float(
            (weights[f"layers.{i}.conv.weight"] - weights[f"layers.{i}.linear.weight"].T)
            .abs()
            .max()
        )
        for i in range(2)
    )


@pytest.mark.distributed
@pytest.mark.parametrize("scaling", ["original", "moonlight"])
def test_a_conv1d_weight_stored_in_out_is_scaled_as_its_linear_twin(scaling: str) -> None:
    pytest.importorskip("transformers")
    for difference in run_distributed(_conv1d_and_linear_after_a_step, 2, scaling):
        assert difference < 1e-6, difference
