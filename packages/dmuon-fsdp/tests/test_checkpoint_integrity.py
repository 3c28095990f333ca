"""Checkpoints you can trust: ``save_checkpoint`` records the CRC32 of every chunk it writes and
``load_checkpoint`` verifies them, on any topology. A data file with flipped bytes, truncated or
deleted, a garbage ``.metadata``, a damaged, stale or deleted checksum record, and in a
checkpoint saved without one (a plain ``dcp.save``) a chunk that fails inside DCP's own read or
a ``.metadata`` that lists too few chunks each raise
``CheckpointIntegrityError`` naming the checkpoint, the file and what is wrong, and leave the
model and the optimizer bit for bit as they were.

One world-2 call saves once and tries every damaged copy; a world-1 call loads the world-2
checkpoint and one damaged copy of it on another topology.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import re
import shutil

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_checkpoint import HYPER, _equal
from test_training import setup_model, train_steps
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dmuon_fsdp import (
    CHECKPOINT_KEY,
    AppState,
    CheckpointIntegrityError,
    Muon,
    get_model_state_dict,
    get_optimizer_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from dmuon_fsdp.checkpoint import _integrity as integrity
from dmuon_fsdp.checkpoint._integrity import CHECKSUMS_FILE
from dmuon_testing.distributed import run_distributed

# Rank 1's data file: its chunks are read by rank 1 alone, after rank 0 has read all of its own.
VICTIM = "__1_0.distcp"


def _state(model, optimizer):
    """Everything a load may change, whole, plus which parameters have optimizer state."""
    return (
        get_model_state_dict(model),
        get_optimizer_state_dict(model, optimizer),
        sorted(id(p) for p in optimizer.state),
    )


def _largest_chunk(path: str, name: str) -> tuple[str, int, int]:
    """(key, offset, length) of the largest chunk DCP stored in file ``name``."""
    metadata = FileSystemReader(path).read_metadata()
    return max(
        (
            (index.fqn, info.offset, info.length)
            for index, info in metadata.storage_data.items()
            if info.relative_path == name
        ),
        key=lambda c: c[2],
    )


def _flip(path: str) -> str:
    key, offset, length = _largest_chunk(path, VICTIM)
    with open(os.path.join(path, VICTIM), "r+b") as f:
        f.seek(offset + length // 2)
        data = f.read(64)
        f.seek(offset + length // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return key


def _truncate(path: str) -> None:
    file = os.path.join(path, VICTIM)
    os.truncate(file, os.path.getsize(file) // 2)


def _delete(path: str) -> None:
    os.remove(os.path.join(path, "__0_0.distcp"))


def _garbage_metadata(path: str) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"this is not a pickle" * 10)


def _edit_record(path: str) -> None:
    """Change one recorded CRC: the record's own checksum must catch it."""
    file = os.path.join(path, CHECKSUMS_FILE)
    with open(file) as f:
        record = json.load(f)
    chunk = record["files"][VICTIM]["chunks"][0]
    chunk[2] ^= 1
    with open(file, "w") as f:
        json.dump(record, f)


def _unrecorded(path: str) -> None:
    """``save_checkpoint``'s record deleted: ``.metadata`` says there was one."""
    os.remove(os.path.join(path, CHECKSUMS_FILE))


def _torn_unrecorded(path: str) -> str:
    """A checkpoint without a record (a plain ``dcp.save``), the largest chunk's header
    overwritten: torch.load fails inside DCP."""
    key, offset, _ = _largest_chunk(path, VICTIM)
    with open(os.path.join(path, VICTIM), "r+b") as f:
        f.seek(offset)
        f.write(b"\x00" * 16)
    return key


def _holes(path: str) -> str:
    """A checkpoint without a record (a plain ``dcp.save``), ``.metadata`` rewritten without the
    chunks of the largest chunk's key: DCP would read nothing into that tensor."""
    key, _, _ = _largest_chunk(path, VICTIM)
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata[key].chunks = []
    with open(file, "wb") as f:
        pickle.dump(metadata, f)
    return key


def _damaged_loads(rank: int, world_size: int, root: str):
    model, _ = setup_model(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    train_steps(model, optimizer, rank, world_size, 2)
    saved = _state(model, optimizer)
    good = os.path.join(root, "good")
    save_checkpoint(good, model, optimizer)
    own = os.path.join(root, "own")  # the same state by a plain dcp.save: no record
    dcp.save({CHECKPOINT_KEY: AppState(model, optimizer)}, checkpoint_id=own)
    # The live state moves on (weights, moments, a hyperparameter), so that any partial load
    # would show.
    train_steps(model, optimizer, rank, world_size, 1, start=2)
    optimizer.param_groups[0]["lr"] *= 0.5
    before = _state(model, optimizer)
    assert not _equal(before[:2], saved[:2])

    cases = {
        "flipped": (good, _flip),
        "truncated": (good, _truncate),
        "deleted": (good, _delete),
        "metadata": (good, _garbage_metadata),
        "record": (good, _edit_record),
        "unrecorded": (good, _unrecorded),
        "torn": (own, _torn_unrecorded),
        "holes": (own, _holes),
    }
    keys: dict[str, str | None] = {}
    errors: dict[str, str] = {}
    unchanged: dict[str, bool] = {}
    for name, (source, damage) in cases.items():
        path = os.path.join(root, name)
        if rank == 0:
            shutil.copytree(source, path)
            keys[name] = damage(path)
        dist.barrier()
        with pytest.raises(CheckpointIntegrityError) as info:
            load_checkpoint(path, model, optimizer)
        errors[name] = str(info.value)
        unchanged[name] = _equal(_state(model, optimizer), before)

    # A record beside a later save that wrote none (the directory saved into again).
    stale = os.path.join(root, "stale")
    if rank == 0:
        shutil.copytree(good, stale)
    dist.barrier()
    dcp.save({CHECKPOINT_KEY: AppState(model, optimizer)}, checkpoint_id=stale)
    with pytest.raises(CheckpointIntegrityError) as info:
        load_checkpoint(stale, model, optimizer)
    errors["stale"] = str(info.value)
    unchanged["stale"] = _equal(_state(model, optimizer), before)

    # Rank 1 alone sees no record where the others do (a shared file system's stale view of a
    # file just written), or gets an I/O error (permissions, a stale file handle): every rank
    # raises, none waits in DCP for it.
    def denied(where, path):
        raise PermissionError(13, "Permission denied", os.path.join(path, CHECKSUMS_FILE))

    for name, read_on_rank_1 in (("unseen", lambda where, path: None), ("denied", denied)):
        real = integrity.read_checksums
        if rank == 1:
            integrity.read_checksums = read_on_rank_1
        try:
            with pytest.raises(CheckpointIntegrityError) as info:
                load_checkpoint(good, model, optimizer)
        finally:
            integrity.read_checksums = real
        errors[name] = str(info.value)
        unchanged[name] = _equal(_state(model, optimizer), before)

    # A plain dcp.load ignores the record; load_checkpoint of the good copy restores it all.
    plain = dcp.load({CHECKPOINT_KEY: AppState(model, optimizer)}, checkpoint_id=good) is None
    plain_same = _equal(_state(model, optimizer)[:2], saved[:2])
    train_steps(model, optimizer, rank, world_size, 1, start=2)
    load_checkpoint(good, model, optimizer)
    round_trip = _equal(_state(model, optimizer), saved)
    return keys, errors, unchanged, plain and plain_same, round_trip, saved[:2]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    return str(root), run_distributed(_damaged_loads, 2, str(root))


@pytest.mark.distributed
def test_damaged_checkpoints_raise_naming_the_file_and_change_nothing(damaged):
    root, results = damaged
    keys, errors, unchanged, _, _, _ = results[0]
    # Every rank reaches the same verdict with the same message, but where one rank alone
    # failed: it raises its own error, the others name it.
    unseen = [r[1].pop("unseen") for r in results]
    denied = [r[1].pop("denied") for r in results]
    assert all(r[1] == errors for r in results)
    assert "and that file is missing" in unseen[1]
    assert "reading checkpoint" in denied[1] and "PermissionError" in denied[1]
    for alone in (unseen, denied):
        assert "failed on rank" not in alone[1]
        assert alone[0].startswith(alone[1]) and alone[0].endswith(
            "[load_checkpoint failed on rank(s) [1]; nothing was loaded on any rank]"
        ), alone
    for name, same in unchanged.items():
        assert same, f"{name}: a failed load changed the model or the optimizer"
    for r in results:
        assert all(r[2].values())

    def path(name: str) -> str:
        return re.escape(repr(os.path.join(root, name)))

    damaged_ = "is damaged, nothing was loaded: "
    want = {
        "flipped": f"{path('flipped')} {damaged_}{VICTIM}: checksum mismatch in"
        f" {re.escape(keys['flipped'])}.* crc32 0x[0-9a-f]{{8}}, the save recorded 0x",
        "truncated": f"{path('truncated')} {damaged_}{VICTIM}: truncated to \\d+ bytes, the"
        " save wrote \\d+",
        "deleted": f"{path('deleted')} {damaged_}__0_0.distcp: missing",
        "metadata": f"{path('metadata')} {damaged_}\\.metadata: checksum mismatch .*"
        "unreadable \\(UnpicklingError",
        "record": f"{path('record')} {damaged_}{CHECKSUMS_FILE}: checksum mismatch: the record"
        " itself changed",
        "unrecorded": f"{path('unrecorded')} was written by dmuon.save_checkpoint, which records"
        f" its checksums in {CHECKSUMS_FILE}, and that file is missing: nothing was loaded",
        "torn": f"{path('torn')} {damaged_}{VICTIM}: reading {re.escape(keys['torn'])} failed \\(",
        "holes": f"{path('holes')} {damaged_}\\.metadata: no saved chunk covers part of"
        f" {re.escape(keys['holes'])}",
        "stale": f"{path('stale')}: {CHECKSUMS_FILE} belongs to another save",
    }
    assert errors.keys() == want.keys()
    for name, pattern in want.items():
        assert re.search(f"^load_checkpoint: checkpoint {pattern}", errors[name]), (
            name,
            errors[name],
        )


@pytest.mark.distributed
def test_good_checkpoint_round_trips_and_plain_dcp_load_still_works(damaged):
    _, results = damaged
    for _, _, _, plain, round_trip, _ in results:
        assert plain, "dcp.load of an AppState from a checksummed checkpoint"
        assert round_trip, "load_checkpoint must restore the saved state bit for bit"


def _load_at_one(rank: int, world_size: int, root: str):
    model, _ = setup_model(world_size, seed=123)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    before = _state(model, optimizer)
    with pytest.raises(CheckpointIntegrityError, match="checksum mismatch") as info:
        load_checkpoint(os.path.join(root, "flipped"), model, optimizer)
    unchanged = _equal(_state(model, optimizer), before)
    load_checkpoint(os.path.join(root, "good"), model, optimizer)
    return str(info.value), unchanged, _state(model, optimizer)[:2]


@pytest.mark.distributed
def test_checksums_verify_on_another_topology(damaged):
    root, saved_at_two = damaged
    error, unchanged, state = run_distributed(_load_at_one, 1, root)[0]
    assert VICTIM in error
    assert unchanged
    with open(os.path.join(root, "good", CHECKSUMS_FILE)) as f:
        record = json.load(f)
    assert sorted(record["files"]) == ["__0_0.distcp", "__1_0.distcp"]
    # The world-2 checkpoint, loaded whole by one rank, is what the two ranks saved.
    assert _equal(state, saved_at_two[0][5])


def _failed_save(rank: int, world_size: int, root: str) -> tuple[str, bool, bool]:
    """Rank 1's write fails (a full disk): every rank gets the same ``RuntimeError``, not DCP's
    ``CheckpointException`` (a ``BaseException`` a loop's ``except Exception`` would miss),
    nothing changes, the directory does not load, and training goes on (see [Note: a save
    that failed])."""
    model, _ = setup_model(world_size)
    optimizer = Muon(model, **HYPER.muon_kwargs())
    train_steps(model, optimizer, rank, world_size, 1)
    before = _state(model, optimizer)
    path = os.path.join(root, "full")
    write = FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, VICTIM))

    if rank == 1:
        FileSystemWriter.write_data = disk_full  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError) as failed:
            save_checkpoint(path, model, optimizer)
    finally:
        FileSystemWriter.write_data = write  # type: ignore[method-assign]
    unchanged = _equal(_state(model, optimizer), before)
    with pytest.raises(CheckpointIntegrityError, match="no finished DCP checkpoint at"):
        load_checkpoint(path, model, optimizer)
    losses = train_steps(model, optimizer, rank, world_size, 1, start=1)
    return str(failed.value), unchanged, all(math.isfinite(x) for x in losses)


@pytest.mark.distributed
def test_a_save_that_fails_on_one_rank_raises_on_every_rank_and_changes_nothing(tmp_path):
    results = run_distributed(_failed_save, 2, str(tmp_path))
    assert results[0][0] == results[1][0]
    message, unchanged, trains = results[0]
    assert message.startswith(f"save_checkpoint: saving the checkpoint {str(tmp_path / 'full')!r}")
    assert f"rank 1: OSError: [Errno {errno.ENOSPC}] No space left on device" in message
    assert VICTIM in message and "rank 0" not in message
    assert "the model and the optimizer are unchanged" in message.lower()
    assert unchanged and trains
