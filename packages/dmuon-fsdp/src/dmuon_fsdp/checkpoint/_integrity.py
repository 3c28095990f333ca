"""Checksums for sharded DCP checkpoints, and a load that reads and checks everything before it
changes anything.

[Note: checkpoint integrity]
What is checked. DCP stores every saved chunk (one rank's shard of a tensor, a whole tensor, or
a pickled value such as the param groups) as one byte range of a ``.distcp`` file, and
``Metadata.storage_data`` maps each chunk to its (file, offset, length). :func:`record_checksums`
writes ``dmuon_checksums.json`` next to ``.metadata``: the CRC32 of every such range, the size
of every data file, the size and CRC32 of ``.metadata`` itself, DCP's ``save_id`` of that save,
and a CRC32 of the record's own content. The record describes the files, not the tensors, so
it holds on any topology: whatever the world size of a load, DCP reads each saved chunk it
needs whole (and narrows it to the part a rank asks for), so every chunk a load uses is
checked as the save wrote it.

How. Saving (:class:`ChecksumWriter`): after DCP's ``write_data`` each rank reads back the
ranges it wrote, usually from the page cache, and checksums them; rank 0 gathers the sums and
writes the record (a temporary file, fsync, rename) after DCP wrote ``.metadata``. Loading,
before DCP runs: the record (its own CRC), ``.metadata`` (its CRC, then unpickled), and every
data file (present, with the size the save wrote; without a record: long enough for its
chunks), all problems in one message. DCP's plan must then fill every element of every tensor
the rank reads (:meth:`ScratchPlanner.create_local_plan`: a ``.metadata`` without a record may
list too few chunks). During DCP's read (:class:`VerifyingReader`) each chunk's bytes are read
whole and compared with their CRC before ``torch.load`` sees them.

All or nothing. DCP reads into CPU scratch tensors (:class:`ScratchPlanner` hands them out in
place of the live ones; tensors nothing live holds yet, the fresh state of parameters not
stepped, are read as they are), and a failure on any rank fails the read on every rank (DCP
gathers the ranks' errors). Only after every rank has read and checked everything, and the
param groups have been checked, are the scratch tensors copied into the model and the
optimizer, copies of checked shapes and dtypes that cannot fail halfway. So a damaged chunk, a
missing file, an I/O error or any other exception inside DCP leaves the model and the optimizer
bit for bit as they were.

Cost. Saving: one read back of what each rank wrote (usually from the page cache) plus CRC32
at the speed of zlib (about 2 GB/s per core), and a gather of about 30 bytes per chunk to rank
0; the record holds as much (chunks are keys x ranks for FSDP2 tensors). Loading: CRC32 of the
bytes DCP reads anyway (no extra read), a stat of every data file, and host memory for a copy
of the live tensors this rank reads, which the install then copies into them (see [Note: what
a load holds] in :mod:`._dcp`). Measured on a CPU, one process, 512 MiB of fp32 tensors in the
page cache: save 1.5 s -> 1.8 s; load 0.87 s -> 0.52 s, faster, since ``torch.load`` of a chunk
held in memory beats ``torch.load`` through DCP's file view.

Limits. A checkpoint without a record (written by your own ``dcp.save`` / ``dcp.async_save``)
loads with the file and size checks and all or nothing, but its bytes are not checked; a
warning says so. One that ``save_checkpoint`` wrote, whose ``.metadata`` says so (its
``save_id`` starts with ``dmuon-checksummed:``), raises without its record instead: the record
was lost (not copied with the checkpoint), or the save stopped between ``.metadata`` and the
record and did not finish; loading its bytes unchecked would make the checksums optional. A record
that belongs to another save than ``.metadata`` (the directory was saved into again without
one) raises rather than being ignored, since a damaged ``.metadata`` could look the same.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._torch_internals import local_shard

__all__ = [
    "CHECKSUMS_FILE",
    "CheckpointIntegrityError",
    "ChecksumWriter",
    "Checksums",
    "ScratchPlanner",
    "VerifyingReader",
    "check_files",
    "clear_checksums",
    "load_verified",
    "read_checksums",
    "read_metadata",
    "record_checksums",
]

logger = logging.getLogger(__name__)

CHECKSUMS_FILE = "dmuon_checksums.json"
_FORMAT = "dmuon-checksums/1"
_METADATA_FILE = ".metadata"
_BLOCK = 64 << 20  # read back in blocks: the checksum pass holds one block, not a whole file
# The start of the save_id of a save that writes a record (ChecksumWriter).
_RECORDED = "dmuon-checksummed:"


class CheckpointIntegrityError(ValueError):
    """A checkpoint that cannot be trusted or read: a data file missing, truncated or changed
    since the save (checksum mismatch), ``.metadata`` unreadable. Raised before the model or
    the optimizer changed; the message names the checkpoint, the file and what is wrong."""


class _Damage(Exception):
    """One problem with one file, raised inside DCP's read and gathered from every rank."""


def _damaged(
    where: str, path: str | os.PathLike[str], problems: Iterable[str]
) -> CheckpointIntegrityError:
    listed = "; ".join(sorted(set(problems)))
    return CheckpointIntegrityError(
        f"{where}: checkpoint {os.fspath(path)!r} is damaged, nothing was loaded: {listed}."
        " Restore the files from a good copy of the checkpoint, or load an older checkpoint"
    )


def _crc(data: bytes | memoryview, value: int = 0) -> int:
    return zlib.crc32(data, value) & 0xFFFFFFFF


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Checksums:
    """A checkpoint's record: see [Note: checkpoint integrity]."""

    save_id: str | None
    metadata_bytes: int
    metadata_crc: int
    file_bytes: dict[str, int]
    # (file, offset) -> (length, crc32) of every chunk.
    chunks: dict[tuple[str, int], tuple[int, int]]


# -- saving -----------------------------------------------------------------------------------


def _checksum_ranges(root: str, ranges: Iterable[tuple[str, int, int]]) -> dict[str, Any]:
    """``{file: {"bytes": size, "chunks": [[offset, length, crc32], ...]}}`` of ``(file,
    offset, length)`` ranges under ``root``, read back from the files."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in ranges:
        by_file.setdefault(name, []).append((offset, length))
    out: dict[str, Any] = {}
    for name, spans in sorted(by_file.items()):
        chunks = []
        with open(os.path.join(root, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for offset, length in sorted(spans):
                f.seek(offset)
                crc, left = 0, length
                while left:
                    block = f.read(min(left, _BLOCK))
                    if not block:
                        raise OSError(
                            f"save_checkpoint: reading back {name} for its checksums: {length}"
                            f" bytes at {offset} were written, fewer could be read"
                        )
                    crc = _crc(block, crc)
                    left -= len(block)
                chunks.append([offset, length, crc])
        out[name] = {"bytes": size, "chunks": chunks}
    return out


class ChecksumWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that checksums the chunks this rank wrote (see [Note:
    checkpoint integrity]); :func:`record_checksums` then writes the record. Its ``save_id``
    in ``.metadata`` starts with :data:`_RECORDED`: a load that finds no record beside it
    knows that one was written, or that the save did not finish."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.written: dict[str, Any] | None = None

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None and meta.save_id is not None:
            meta.save_id = f"{_RECORDED}{meta.save_id}"
        return meta

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        results = future.wait()
        # A failure here fails DCP's write step on every rank, before .metadata is written.
        self.written = _checksum_ranges(
            os.fspath(self.path),
            (
                (r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length)
                for r in results
            ),
        )
        return future


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def clear_checksums(path: str | os.PathLike[str]) -> None:
    """Remove a record left by an earlier save into ``path`` (rank 0 only), so that a save that
    fails before writing its own leaves none that could be mistaken for its."""
    if _world()[0] == 0:
        try:
            os.remove(os.path.join(path, CHECKSUMS_FILE))
        except FileNotFoundError:
            pass


def record_checksums(writer: ChecksumWriter, where: str) -> None:
    """Gather every rank's checksums (from ``writer``, after ``dcp.save`` returned) and write
    the record on rank 0; collective over the default process group. Raises on every rank when
    the record could not be written."""
    rank, world = _world()
    root = os.fspath(writer.path)
    assert writer.written is not None, "record_checksums runs after a dcp.save with this writer"
    parts: list[Any] = [writer.written]
    if world > 1:
        parts = [None] * world if rank == 0 else []
        dist.gather_object(writer.written, parts if rank == 0 else None, dst=0)
    error: list[str | None] = [None]
    if rank == 0:
        try:
            _write_record(root, parts)
        except Exception as exc:  # every rank must hear of it, or they wait at the broadcast
            error[0] = f"{type(exc).__name__}: {exc}"
    if world > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise OSError(
            f"{where}: checkpoint {root!r} was written but its {CHECKSUMS_FILE} could not be"
            f" ({error[0]}), so load_checkpoint will refuse it (its .metadata says a record was"
            " written). Free space or fix permissions and save again"
        )


def _write_record(root: str, parts: Sequence[Mapping[str, Any]]) -> None:
    metadata_path = os.path.join(root, _METADATA_FILE)
    with open(metadata_path, "rb") as f:
        raw = f.read()
    metadata = pickle.loads(raw)
    files: dict[str, Any] = {}
    for part in parts:
        files.update(part)
    body = {
        "format": _FORMAT,
        "algorithm": "crc32",
        "save_id": getattr(getattr(metadata, "storage_meta", None), "save_id", None),
        "metadata": {"bytes": len(raw), "crc32": _crc(raw)},
        "files": files,
    }
    record = {**body, "crc32": _crc(_canonical(body))}
    tmp = os.path.join(root, f"{CHECKSUMS_FILE}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, CHECKSUMS_FILE))


# -- loading: before DCP ----------------------------------------------------------------------


def read_checksums(where: str, path: str | os.PathLike[str]) -> Checksums | None:
    """The checkpoint's record, or ``None`` when it has none (see [Note: checkpoint
    integrity])."""
    file = os.path.join(path, CHECKSUMS_FILE)
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(raw)
        stored = record.pop("crc32")
        problem = None
        if record.get("format") != _FORMAT:
            problem = f"format {record.get('format')!r}, expected {_FORMAT!r}"
        elif _crc(_canonical(record)) != stored:
            problem = "checksum mismatch: the record itself changed after the save"
        else:
            return Checksums(
                save_id=record["save_id"],
                metadata_bytes=int(record["metadata"]["bytes"]),
                metadata_crc=int(record["metadata"]["crc32"]),
                file_bytes={name: int(entry["bytes"]) for name, entry in record["files"].items()},
                chunks={
                    (name, int(offset)): (int(length), int(crc))
                    for name, entry in record["files"].items()
                    for offset, length, crc in entry["chunks"]
                },
            )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        problem = f"unreadable ({type(exc).__name__}: {exc})"
    raise _damaged(where, path, [f"{CHECKSUMS_FILE}: {problem}"])


def read_metadata(
    where: str, path: str | os.PathLike[str], checksums: Checksums | None
) -> Metadata:
    """The checkpoint's ``.metadata``, checked against the record when there is one."""
    file = os.path.join(path, _METADATA_FILE)
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        reason = "the directory does not exist" if not os.path.isdir(path) else "no .metadata"
        raise CheckpointIntegrityError(
            f"{where}: no finished DCP checkpoint at {os.fspath(path)!r} ({reason}): the save did"
            " not finish, or the path is wrong"
        ) from None
    metadata: Any = None
    unreadable = None
    try:
        metadata = pickle.loads(raw)
        if not isinstance(metadata, Metadata):
            unreadable = f"holds a {type(metadata).__name__}, not DCP's Metadata"
    except Exception as exc:
        unreadable = f"{type(exc).__name__}: {exc}"
    if checksums is not None and (len(raw), _crc(raw)) != (
        checksums.metadata_bytes,
        checksums.metadata_crc,
    ):
        save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
        if unreadable is None and save_id != checksums.save_id:
            raise CheckpointIntegrityError(
                f"{where}: checkpoint {os.fspath(path)!r}: {CHECKSUMS_FILE} belongs to another"
                f" save ({checksums.save_id}) than .metadata ({save_id}): the directory was"
                f" saved into again without checksums. Remove {CHECKSUMS_FILE} to load it"
                " without checking its bytes, or save with dmuon.save_checkpoint"
            )
        raise _damaged(
            where,
            path,
            [
                f"{_METADATA_FILE}: checksum mismatch ({len(raw)} bytes, crc32 {_crc(raw):#010x};"
                f" the save wrote {checksums.metadata_bytes} bytes, crc32"
                f" {checksums.metadata_crc:#010x})"
                + ("" if unreadable is None else f", unreadable ({unreadable})")
            ],
        )
    if unreadable is not None:
        raise _damaged(where, path, [f"{_METADATA_FILE}: unreadable ({unreadable})"])
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    if checksums is None and str(metadata.storage_meta.save_id).startswith(_RECORDED):
        raise CheckpointIntegrityError(
            f"{where}: checkpoint {os.fspath(path)!r} was written by dmuon.save_checkpoint,"
            f" which records its checksums in {CHECKSUMS_FILE}, and that file is missing:"
            " nothing was loaded. Copy it with the checkpoint's other files (a save that"
            " stopped before writing it did not finish: load an earlier checkpoint)"
        )
    return metadata


def _entry(index: MetadataIndex) -> str:
    """A chunk as messages name it: its key, and its offset when it is a shard."""
    if index.offset is not None and any(index.offset):
        return f"{index.fqn} (chunk at {list(index.offset)})"
    return index.fqn


def check_files(
    where: str,
    path: str | os.PathLike[str],
    metadata: Metadata,
    checksums: Checksums | None,
) -> None:
    """Every data file present with the size the save wrote (without a record: long enough for
    its chunks), and every chunk covered by the record; raises naming every problem."""
    needs: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        needs[name] = max(needs.get(name, 0), info.offset + info.length)
        if checksums is not None:
            recorded = checksums.chunks.get((name, info.offset))
            if recorded is None or recorded[0] != info.length:
                raise _damaged(
                    where,
                    path,
                    [
                        f"{CHECKSUMS_FILE} does not describe {_entry(index)} in {name} (bytes"
                        f" {info.offset}..{info.offset + info.length} per .metadata)"
                    ],
                )
    problems = []
    for name, need in sorted(needs.items()):
        try:
            size = os.path.getsize(os.path.join(path, name))
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        expected = None if checksums is None else checksums.file_bytes.get(name)
        if expected is not None and size != expected:
            what = "truncated to" if size < expected else "grown to"
            problems.append(f"{name}: {what} {size} bytes, the save wrote {expected}")
        elif size < need:
            problems.append(f"{name}: truncated to {size} bytes, its chunks need {need}")
    if problems:
        raise _damaged(where, path, problems)


# -- loading: DCP's read ----------------------------------------------------------------------


class VerifyingReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that reads each chunk whole and checks it against the record
    before deserialising it (see [Note: checkpoint integrity]), and hands DCP the ``.metadata``
    that was checked. Every failure inside its read becomes a :class:`_Damage` naming the file
    and the chunk.

    [Note: one chunk in flight]
    ``FileSystemReader.read_data`` keeps a chunk's bytes and the tensor ``torch.load`` made of
    them in loop variables until the next chunk replaces them, so while it reads a chunk it
    still holds the previous one twice: four chunk-sized buffers at a time. This reader runs
    that loop with one chunk per call of :meth:`_read_item`, in which the bytes are dropped as
    soon as ``torch.load`` has made its tensor and the tensor once it is copied into its target
    (allocated only then, see :class:`ScratchPlanner`): beyond its targets a rank holds at most
    one chunk's bytes and its tensor."""

    def __init__(
        self, path: str | os.PathLike[str], metadata: Metadata, checksums: Checksums | None
    ) -> None:
        super().__init__(path)
        self.metadata = metadata
        self.checksums = checksums
        self.names = {
            (info.relative_path, info.offset): index
            for index, info in metadata.storage_data.items()
        }
        self.current: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        assert self.metadata.storage_meta is not None
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def _slice_file(self, file: Any, sinfo: Any) -> io.BytesIO:
        name, offset, length = sinfo.relative_path, sinfo.offset, sinfo.length
        self.current = sinfo
        entry = _entry(self.names[(name, offset)])
        file.seek(offset)
        data = file.read(length)
        if len(data) != length:
            raise _Damage(
                f"{name}: truncated: {entry} needs bytes {offset}..{offset + length}, the file"
                f" ends at {offset + len(data)}"
            )
        if self.checksums is not None:
            _, want = self.checksums.chunks[(name, offset)]
            got = _crc(data)
            if got != want:
                raise _Damage(
                    f"{name}: checksum mismatch in {entry} (bytes {offset}..{offset + length}:"
                    f" crc32 {got:#010x}, the save recorded {want:#010x})"
                )
        return io.BytesIO(data)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        try:
            for name, items in per_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                    for item in items:
                        self._read_item(stream, item, planner)
        except _Damage:
            raise
        except Exception as exc:
            # The chunk being read when it failed; an OSError names its file itself (a file
            # that could not be opened is not the last chunk's).
            sinfo = self.current
            if isinstance(exc, OSError) and exc.filename is not None:
                at = f"{os.path.basename(str(exc.filename))}: reading"
            elif sinfo is None:
                at = "reading"
            else:
                entry = _entry(self.names[(sinfo.relative_path, sinfo.offset)])
                at = f"{sinfo.relative_path}: reading {entry}"
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            if len(text) > 200:
                text = text[:200] + "..."
            raise _Damage(f"{at} failed ({type(exc).__name__}: {text})") from exc
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, stream: Any, item: ReadItem, planner: LoadPlanner) -> None:
        """One chunk, read whole and checked, into its target (see [Note: one chunk in
        flight]): DCP's own steps (its load-stream transforms, ``torch.load``, the narrowing
        to the requested part), in the order that frees each buffer first."""
        info = self.storage_data[item.storage_index]
        data: Any = self.transforms.transform_load_stream(
            item, info.transform_descriptors or (), self._slice_file(stream, info)
        )
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(data.read(-1)))
            return
        if not data.seekable():
            data = io.BytesIO(data.read(-1))
        loaded = torch.load(data, map_location="cpu", weights_only=True)
        del data
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            if length < loaded.size(dim):
                loaded = loaded.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != loaded.size():
            raise AssertionError(
                f"chunk {item.storage_index} has size {tuple(loaded.size())}, its target"
                f" {tuple(target.size())}"
            )
        target.copy_(loaded)
        del loaded
        planner.commit_tensor(item, target)


class ScratchPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading every live tensor into a CPU scratch tensor instead;
    :meth:`install` copies them over once the whole read succeeded (see [Note: checkpoint
    integrity]). The keys in ``direct`` name tensors nothing live holds yet (a parameter's
    optimizer state before its first step): DCP reads into them as they are, and one whose
    storage is empty gets its bytes when its first chunk arrives, so a rank never holds a
    target before it is filled."""

    def __init__(self, direct: Iterable[str] = ()) -> None:
        super().__init__()
        self.direct = frozenset(direct)
        # Flat key -> (the live local tensor, its scratch copy).
        self.scratch: dict[str, tuple[Tensor, Tensor]] = {}

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan, checked to fill every element of every tensor this rank reads: a
        ``.metadata`` without a record could list too few chunks for a key, which DCP would
        leave unread (a scratch copy's garbage installed, a fresh state without storage)."""
        plan = super().create_local_plan()
        filled: dict[str, int] = {}
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                key = item.dest_index.fqn
                filled[key] = filled.get(key, 0) + math.prod(item.lengths)
        short = [
            key
            for key, value in self.state_dict.items()
            if isinstance(value, Tensor) and filled.get(key, 0) < local_shard(value).numel()
        ]
        if short:
            raise _Damage(f".metadata: no saved chunk covers part of {', '.join(short)}")
        return plan

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        if index.fqn in self.direct:
            target = super().lookup_tensor(index).detach()
            storage = target.untyped_storage()
            need = int(target.storage_offset() + target.numel()) * target.element_size()
            if storage.nbytes() < need:
                storage.resize_(need)
            return target
        pair = self.scratch.get(index.fqn)
        if pair is None:
            live = super().lookup_tensor(index).detach()
            pair = (live, torch.empty(live.shape, dtype=live.dtype, device="cpu"))
            self.scratch[index.fqn] = pair
        return pair[1]

    def install(self) -> None:
        with torch.no_grad():
            for live, copy in self.scratch.values():
                live.copy_(copy)


def load_verified(
    where: str,
    path: str | os.PathLike[str],
    state_dict: dict[str, Any],
    metadata: Metadata,
    checksums: Checksums | None,
    direct: Iterable[str] = (),
) -> ScratchPlanner:
    """``dcp.load`` of ``state_dict`` into scratch tensors with every chunk checked; collective.
    Returns the planner holding them; nothing live has changed yet. ``direct`` names the
    flattened keys whose tensors nothing live holds, read in place (see
    :class:`ScratchPlanner`). A checkpoint without a record is loaded with its sizes checked
    only, and a warning."""
    if checksums is None and _world()[0] == 0:
        logger.warning(
            "%s: checkpoint %r has no %s (it was not written by dmuon.save_checkpoint): its"
            " files and sizes are checked, its bytes are not",
            where,
            os.fspath(path),
            CHECKSUMS_FILE,
        )
    planner = ScratchPlanner(direct)
    try:
        dcp.load(
            state_dict,
            storage_reader=VerifyingReader(path, metadata, checksums),
            planner=planner,
        )
    except CheckpointException as exc:
        problems = [str(e) for e, _ in exc.failures.values() if isinstance(e, _Damage)]
        if not problems:
            raise
        raise _damaged(where, path, problems) from exc
    return planner
