"""The step profile: every phase listed, their sum is the step, and profiling changes no bit."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import weakref

import pytest
import torch
from _models import muon_predicate
from _reference import Hyper, lm_loss, make_batch, shard
from _sgd_train import setup_model
from torch.distributed.fsdp import FSDPModule

from dmuon_fsdp import (
    Muon,
    StepOptions,
    collect_forward_unshard_profile,
    get_model_state_dict,
    summarize_param_groups,
)
from dmuon_fsdp._profile import span
from dmuon_testing.distributed import run_distributed

HYPER = Hyper()
STEPS = 6
PHASES = {"pre_step", "wait_reduces", "nonfinite_check", "muon_update", "adamw", "publish"}


def _run(rank: int, world_size: int, profile: bool):
    model, _ = setup_model(world_size, small_param_threshold=0)
    optimizer = Muon(model, **HYPER.muon_kwargs(), options=StepOptions(profile=profile))
    losses, profiles, step_ms = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = lm_loss(model, shard(make_batch(step, 8, 8, 32), rank, world_size))
        loss.backward()
        start = time.perf_counter()
        optimizer.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss))
        if profile:
            profiles.append(optimizer.step_profile())
    waits = [b["forward_wait_ms"] for b in collect_forward_unshard_profile(model)["boundaries"]]
    rows = summarize_param_groups(model, optimizer, max_rows=3)
    del optimizer
    return losses, get_model_state_dict(model), profiles, step_ms, waits, rows, _after(model)


def _after(model: torch.nn.Module) -> list[object]:
    """What the next forwards time, after the optimizer is freed and after a profiled
    ``Muon`` and then an unprofiled one are built on the model: the profiled one's timers
    outlived it (a mark per boundary in every later forward) and an unprofiled one built
    later kept them."""

    def waits() -> list[float | None]:
        with torch.no_grad():
            model(make_batch(0, 2, 8, 32))
        for module in model.modules():  # FSDP2 kept the root's parameters gathered
            if isinstance(module, FSDPModule):
                module.reshard()
        profile = collect_forward_unshard_profile(model, clear=True)
        return [b["forward_wait_ms"] for b in profile["boundaries"]]

    gc.collect()  # _run's optimizer is freed
    seen: list[object] = [waits()]
    profiled = Muon(model, **HYPER.muon_kwargs(), options=StepOptions(profile=True))
    freed = weakref.ref(profiled)
    seen.append(waits())
    del profiled
    gc.collect()
    seen += [freed() is None, waits()]
    profiled = Muon(model, **HYPER.muon_kwargs(), options=StepOptions(profile=True))
    Muon(model, **HYPER.muon_kwargs())  # built last, while the profiled one lives
    seen.append(waits())
    del profiled
    return seen


@pytest.mark.distributed
def test_step_profile_lists_every_phase_sums_to_the_step_and_changes_nothing() -> None:
    profiled = run_distributed(_run, 2, True)
    plain = run_distributed(_run, 2, False)
    for with_profile, without in zip(profiled, plain):
        assert with_profile[0] == without[0], "profiling changed a loss"
        assert all(torch.equal(with_profile[1][k], v) for k, v in without[1].items())
        _, _, profiles, step_ms, waits, rows, after = with_profile
        # Forwards are timed while a profiled Muon lives, and only then.
        deleted, live, freed, deleted_again, later_unprofiled = after
        assert freed and all(w is not None and w >= 0 for w in live), after
        assert all(w is None for w in deleted + deleted_again + later_unprofiled), after
        assert all(w is None for w in without[6][0] + without[6][3] + without[6][4])
        for phases in profiles:
            names = set(phases)
            assert PHASES <= names, PHASES - names
            assert any(name.startswith("ns[") for name in names), names
        # The phases cover the step from its first line to its last, so only the call itself
        # lies outside them. Per step after the first (which makes the states), the median:
        # a preemption or a garbage collection of this busy test process that lands in the
        # call's few lines in one step says nothing about what the phases cover.
        outside = [ms - sum(p.values()) for p, ms in zip(profiles[1:], step_ms[1:])]
        step = statistics.median(step_ms[1:])
        assert abs(statistics.median(outside)) <= 0.1 * step, (profiles, step_ms)
        assert all(w is not None and w >= 0 for w in waits)
        muon_group = next(g for g in rows if g["optimizer"] == "muon")
        assert len(muon_group["rows"]) == 3 and muon_group["rows_omitted"] > 0
        row = muon_group["rows"][0]
        assert row["route"] == "muon" and row["dtype"] == "float32" and len(row["shape"]) == 2
        assert row["owner_rank"] in (0, 1) and muon_predicate(row["name"], torch.zeros(2, 2))
    # Without the profile there is nothing to read.
    assert all(r[2] == [] and all(w is None for w in r[4]) for r in plain)


def _unprofiled_read(rank: int, world_size: int) -> None:
    model, _ = setup_model(world_size)
    with pytest.raises(ValueError, match=r"options=dmuon\.StepOptions\(profile=True\)"):
        Muon(model).step_profile()


@pytest.mark.distributed
def test_step_profile_needs_the_option() -> None:
    run_distributed(_unprofiled_read, 1)


def _profiler_ranges(rank: int, world_size: int) -> set[str]:
    model, _ = setup_model(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())

    def step(i: int) -> None:
        optimizer.zero_grad()
        lm_loss(model, shard(make_batch(i, 8, 8, 32), rank, world_size)).backward()
        optimizer.step()

    step(0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        step(1)
    return {event.name for event in prof.events() if event.name.startswith("dmuon::")}


@pytest.mark.distributed
def test_profiler_ranges_appear_while_a_profiler_runs_and_cost_nothing_otherwise() -> None:
    """[Note: profiler ranges]: under ``torch.profiler`` the hooks, the reduce and the step
    show as named ranges; without one, ``span`` opens no ``record_function``."""
    for names in run_distributed(_profiler_ranges, 2):
        expected = {
            "dmuon::pre_forward",
            "dmuon::post_forward",
            "dmuon::pre_backward",
            "dmuon::post_backward",
            "dmuon::reduce",
            "dmuon::optimizer_step",
            "dmuon::muon_step",
        }
        assert expected <= names, expected - names
    assert isinstance(span("dmuon::anything"), contextlib.nullcontext)
