"""A persistent pool of gloo worker processes for distributed tests on CPU.

    from dmuon_testing.distributed import run_distributed

    def _body(rank: int, world_size: int, scale: float) -> float:   # module-level, picklable
        t = torch.full((1,), float(rank))
        dist.all_reduce(t)
        return t.item() * scale

    def test_sum():
        assert run_distributed(_body, 4, 2.0) == [12.0] * 4

Each world size gets one pool, started on first use and kept for the whole pytest process, so
that a test pays for a function call, not for spawning processes and importing torch. Workers
run with one intra-op thread and a short collective timeout: a mismatched collective fails the
test instead of hanging it. A failed call tears its pool down (its process group may be
unusable); the next call starts a new one.
"""

from __future__ import annotations

import atexit
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 45.0
CALL_TIMEOUT_S = 300.0
_POLL_S = 0.5

_pools: dict[int, _Pool] = {}


class DistributedTestError(AssertionError):
    """One or more ranks raised; the message holds every rank's traceback."""


def _worker(rank: int, world_size: int, init_file: str, inbox: Any, outbox: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("DMUON_TESTING_WORKER", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix="dmuon-gloo-")
        init_file = os.path.join(self._dir.name, "init")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, init_file, self._inboxes[rank], self._outbox),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list:
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        failures: list[str] = []
        deadline = time.monotonic() + timeout
        answered = 0
        while answered < self.world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                # A rank that crashed (a segfault, say) never answers: fail now, not at the
                # deadline, and say how it ended.
                dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
                if dead or time.monotonic() > deadline:
                    reason = (
                        f"ranks {sorted(dead)} died (exit codes {list(dead.values())})"
                        if dead
                        else f"no answer from every rank within {timeout:.0f} s"
                    )
                    raise DistributedTestError(
                        f"{fn.__name__}: {reason}; failures so far:\n" + "\n".join(failures)
                    ) from None
                continue
            answered += 1
            if ok:
                results[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            raise DistributedTestError(f"{fn.__name__} failed:\n" + "\n".join(sorted(failures)))
        return results

    def close(self) -> None:
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self._dir.cleanup()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = CALL_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank of a gloo world of
    ``world_size`` processes and return the per-rank results (rank order). ``fn`` must be a
    module-level function (it is pickled by reference); results must be picklable."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = _Pool(world_size)
    try:
        return pool.call(fn, args, kwargs, timeout)
    except BaseException:
        _pools.pop(world_size).close()
        raise


@atexit.register
def _close_all() -> None:
    while _pools:
        _pools.popitem()[1].close()


@contextmanager
def one_gpu_world() -> Iterator[torch.device]:
    """This process as a one-rank NCCL world on the first GPU (the GPU tests' single card);
    yields that device and destroys the process group on the way out."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with tempfile.NamedTemporaryFile() as init:
        dist.init_process_group(
            "nccl", init_method=f"file://{init.name}", rank=0, world_size=1, device_id=device
        )
        try:
            yield device
        finally:
            dist.destroy_process_group()
