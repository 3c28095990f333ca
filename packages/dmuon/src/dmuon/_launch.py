"""Start N local ranks for the demo, or join a world that torchrun already started.

``spawn`` runs ``fn(ctx, *args)`` on ``nproc`` fresh processes (``torch.multiprocessing``,
spawn start method) joined by a file rendezvous; rank 0 streams events back to the parent
through a queue and every rank returns a result. The parent owns the terminal, so progress
lines come out in order and tests can capture them. ``torchrun_world`` is the same contract
for a process that torchrun started: events are handled in-process on rank 0.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankContext", "choose_backend", "spawn", "torchrun_world"]

# A rank that waits this long on a collective has lost its peers; fail instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class RankContext:
    """What a rank's function gets: its place in the world, its device and an event sink."""

    rank: int
    world_size: int
    device: torch.device
    emit: Callable[[Any], None]  # only rank 0's events reach the parent


def choose_backend(device: str, nproc: int) -> tuple[str, str]:
    """(device type, process group backend) for ``device`` in {"auto", "cpu", "cuda"}.
    "auto" picks CUDA + NCCL only when there is one GPU per rank."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < nproc:
        raise ValueError(
            f"--device cuda needs one GPU per rank: nproc={nproc} but {gpus} GPU(s) are visible;"
            " lower --nproc or use --device cpu"
        )
    if device == "cuda" or (device == "auto" and gpus >= nproc):
        return "cuda", "nccl"
    return "cpu", "gloo"


def _drop(event: Any) -> None:
    """The event sink of every rank but 0."""


def _init(rank: int, world_size: int, device_type: str, backend: str, init: str | None) -> Any:
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        # Ranks share the machine's cores; more threads than cores per rank only thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    kwargs: dict[str, Any] = {"backend": backend, "timeout": COLLECTIVE_TIMEOUT}
    if init is not None:
        kwargs.update(init_method=init, rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)
    return device


def _entry(
    rank: int,
    world_size: int,
    device_type: str,
    backend: str,
    init: str,
    events: Any,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    try:
        device = _init(rank, world_size, device_type, backend, init)
        emit = (lambda ev: events.put(("event", rank, ev))) if rank == 0 else _drop
        ctx = RankContext(rank, world_size, device, emit)
        result = fn(ctx, *args)
        events.put(("done", rank, result))
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple,
    *,
    device_type: str,
    backend: str,
    on_event: Callable[[Any], None],
) -> list[Any]:
    """Run ``fn(RankContext, *args)`` on ``nproc`` new processes; return the per-rank results.
    ``fn`` must be a module-level function. Rank 0's events go to ``on_event`` as they come.
    If a rank fails, the others are stopped and a RuntimeError carries its traceback."""
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dmuon-demo-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [
            ctx.Process(
                target=_entry,
                args=(rank, nproc, device_type, backend, init, events, fn, args),
                daemon=True,
            )
            for rank in range(nproc)
        ]
        for proc in procs:
            proc.start()
        results: dict[int, Any] = {}
        finished = False
        try:
            while len(results) < nproc:
                try:
                    kind, rank, payload = events.get(timeout=0.5)
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)
                    ]
                    if dead:
                        raise RuntimeError(
                            f"rank(s) {dead} died without a report (exit codes"
                            f" {[procs[r].exitcode for r in dead]})"
                        ) from None
                    continue
                if kind == "event":
                    on_event(payload)
                elif kind == "done":
                    results[rank] = payload
                else:
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
            finished = True
        finally:
            # After success the ranks are only tearing down their process group; after a
            # failure the survivors may be blocked in a collective, so stop them at once.
            deadline = time.monotonic() + (10 if finished else 0)
            for proc in procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.terminate()
                    proc.join()
    return [results[r] for r in range(nproc)]


def torchrun_world(
    fn: Callable[..., Any], args: tuple, *, device: str, on_event: Callable[[Any], None]
) -> Any:
    """Run ``fn(RankContext, *args)`` in this process as one rank of a torchrun world
    (RANK / WORLD_SIZE / LOCAL_RANK from the environment); returns this rank's result."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device_type, backend = choose_backend(device, local_world)
    dev = _init(rank, world_size, device_type, backend, None)
    try:
        emit = on_event if rank == 0 else _drop
        return fn(RankContext(rank, world_size, dev, emit), *args)
    finally:
        dist.destroy_process_group()
