"""Content checksums of a training state (:mod:`fastamp.resume`): what a save records of its bytes
and what a load verifies before anything is restored.

``torch.load`` and ``torch.distributed.checkpoint`` verify nothing of what they read (torch's zip
reader skips the records' CRC-32): bytes overwritten in place load as NaN moments or another RNG
state. So every file of a training state carries checksums of its own content:

* a file written with ``torch.save`` (the checkpoint, each rank's file) holds a ``"checksums"``
  entry: one digest per tensor, of its bytes (``fastamp::tensor_digest``, on the tensor's device,
  so a CUDA state is hashed where it lives), and one per top-level entry of everything else in it
  (numbers, strings, the python RNG state, each tensor's dtype and shape), hashed with BLAKE2b.
  The load recomputes them from what ``torch.load`` returned, before any check or restore;
* the files ``torch.distributed.checkpoint`` writes (a sharded model's and optimizer's tensors)
  are hashed as bytes, entry by entry as its ``.metadata`` file lays them out (and the bytes
  between entries, and ``.metadata`` itself), after the save; the digests go into the checkpoint
  file (:class:`fastamp.resume._sharded.ShardedState`), and a load verifies every file before
  ``torch.distributed.checkpoint`` reads any, each rank a share of them.

The files written with ``torch.save`` are written without its CRC-32 of each record
(:func:`fastamp.resume._io.atomic_save`): no reader checks it, and computing it took longer than
these digests (a single-threaded pass over every byte); the digests, checked at every load, take
its place.

A difference raises :class:`ChecksumError` (a ``RuntimeError``) naming the file, the entry, and the
digest found against the one recorded. Bytes that reach no restored value (the zip archive's
alignment padding) are not covered: changing them changes nothing that is restored.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor

from fastamp.checkpoint import ops as checkpoint_ops

__all__ = ["ALGORITHM", "ChecksumError", "file_digests", "seal", "verify", "verify_files"]

# What the digests are, recorded beside them: a checkpoint hashed otherwise is refused by name.
# "+names": each top-level entry's digest covers its name too. pickle writes a string once and
# refers back to it, so the name of an entry and the key of its recorded digest are the same bytes
# in the file: a bit flipped there renames both, and a digest of the value alone still matched.
ALGORITHM = "fastamp.tensor_digest2+blake2b-64+names"
# The same digests without the names (files saved before): verified as they were computed.
_WITHOUT_NAMES = "fastamp.tensor_digest2+blake2b-64"
# Digests earlier development builds recorded (tensor_digest's first term, a splitmix64 mix of each
# word): their files cannot be verified by this version, and are refused by name.
_EARLIER = ("fastamp.tensor_digest+blake2b-64",)
_KEY = "checksums"
_MASK = (1 << 64) - 1
_READ_CHUNK = 64 << 20  # bytes of a DCP file read (and hashed) at a time


class ChecksumError(RuntimeError):
    """A file's content differs from what its save recorded (raised before anything changes)."""


def _hex(d: int) -> str:
    return f"{d & _MASK:#018x}"


def _leaf(value: Any, h: Any) -> None:
    if isinstance(value, (bytes, bytearray)):
        h.update(b"b%d:" % len(value))
        h.update(value)
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


def _walk(value: Any, path: str, h: Any, tensors: list[tuple[str, Tensor]]) -> None:
    """Feeds the non-tensor content of ``value`` (with each tensor's dtype and shape) to ``h``,
    and collects its tensors by path, in a deterministic order (that of the containers)."""
    if isinstance(value, Tensor):
        h.update(f"T:{value.dtype}:{tuple(value.shape)};".encode())
        tensors.append((path, value))
    elif isinstance(value, Mapping):
        h.update(b"{")
        for k, v in value.items():
            _leaf(k, h)
            _walk(v, f"{path}.{k}", h, tensors)
        h.update(b"}")
    elif type(value) in (list, tuple):
        h.update(b"[" if type(value) is list else b"(")
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]", h, tensors)
        h.update(b"]")
    else:
        _leaf(value, h)


def _hashable(t: Tensor) -> Tensor | None:
    """The dense tensor whose bytes stand for ``t`` (None: it has no data, as on 'meta')."""
    from fastamp._sharding import is_dtensor, local

    if is_dtensor(t):
        t = local(t)
    if t.device.type == "meta":
        return None
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.device.type not in ("cpu", "cuda"):
        t = t.cpu()
    return t.detach()


def _tensor_digests(tensors: list[Tensor]) -> list[int]:
    """``fastamp::tensor_digest`` of each tensor: one call per device, read back once."""
    out = [0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    dense: list[Tensor | None] = [_hashable(t) for t in tensors]
    for i, t in enumerate(dense):
        if t is not None:
            by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        digests = checkpoint_ops.tensor_digest([cast(Tensor, dense[i]) for i in idx]).tolist()
        for i, d in zip(idx, digests):
            out[i] = d & _MASK
    return out


def _checksums(obj: Mapping[str, Any], names: bool = True) -> dict[str, int]:
    """Entry name -> digest: ``"<key>"`` for the non-tensor content of each top-level entry (and,
    with ``names``, the key itself), ``"<key>.<path>"`` for each tensor in it."""
    out: dict[str, int] = {}
    tensors: list[tuple[str, Tensor]] = []
    for key, value in obj.items():
        if key == _KEY:
            continue
        h = hashlib.blake2b(digest_size=8)
        if names:
            _leaf(key, h)
        _walk(value, str(key), h, tensors)
        out[str(key)] = int.from_bytes(h.digest(), "little")
    for (name, _), d in zip(tensors, _tensor_digests([t for _, t in tensors])):
        out[name] = d
    return out


def seal(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with its ``"checksums"`` entry (what :func:`verify` checks), ready for torch.save."""
    return {**obj, _KEY: {"algorithm": ALGORITHM, "entries": _checksums(obj)}}


def _damaged(path: str, why: str) -> ChecksumError:
    return ChecksumError(
        f"load_training_state: {path!r} is damaged: {why}. Its bytes changed after the save "
        "(disk, network file system, copy); nothing was restored. Resume from another checkpoint"
    )


def verify(obj: Mapping[str, Any], path: str) -> None:
    """Recomputes the checksums of what torch.load read from ``path``; raises
    :class:`ChecksumError` naming the first entry whose content differs."""
    recorded = obj.get(_KEY)
    if isinstance(recorded, Mapping) and recorded.get("algorithm") in _EARLIER:
        raise RuntimeError(
            f"load_training_state: {path!r} was written by a development version of fastamp "
            f"whose checksums ({recorded['algorithm']}) this version ({ALGORITHM}) does not "
            "compute, so its bytes cannot be verified; this version refuses it. Resume it with "
            "the fastamp that wrote it and save again, or read its parts with torch.load(path, "
            "weights_only=True)"
        )
    if (
        not isinstance(recorded, Mapping)
        or recorded.get("algorithm") not in (ALGORITHM, _WITHOUT_NAMES)
        or not isinstance(recorded.get("entries"), Mapping)
    ):
        raise _damaged(path, f"its {_KEY!r} entry is missing or unreadable ({recorded!r:.120})")
    want = recorded["entries"]
    got = _checksums(obj, names=recorded["algorithm"] == ALGORITHM)
    for name in list(want) + [n for n in got if n not in want]:
        if name not in got:
            raise _damaged(path, f"its entry {name!r} is missing (a checksum was recorded for it)")
        if name not in want:
            raise _damaged(path, f"its entry {name!r} has no recorded checksum")
        if got[name] != want[name]:
            what = "values" if name in obj else "tensor bytes"
            raise _damaged(
                path,
                f"the checksum of its entry {name!r} ({what}) is {_hex(got[name])}, the save "
                f"recorded {_hex(want[name])}",
            )


# ------------------------------------------------- torch.distributed.checkpoint's files, as bytes


def _layout(folder: str) -> dict[str, list[tuple[str, int, int]]]:
    """File name -> its entries ``(name, offset, length)`` by offset, from the ``.metadata`` file
    of the torch.distributed.checkpoint directory ``folder``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    metadata = FileSystemReader(folder).read_metadata()
    files: dict[str, list[tuple[str, int, int]]] = {}
    for index, info in metadata.storage_data.items():
        offset = getattr(index, "offset", None)
        name = str(index.fqn) + (f" chunk {tuple(offset)}" if offset is not None else "")
        files.setdefault(info.relative_path, []).append((name, info.offset, info.length))
    for entries in files.values():
        entries.sort(key=lambda e: e[1])
    return files


def _digest_ranges(path: str, ranges: list[tuple[str, int, int]]) -> list[int]:
    """The digest of each byte range of the file ``path`` (one read buffer, reused)."""
    out = []
    buf = bytearray(min(_READ_CHUNK, max((n for _, _, n in ranges), default=0)) or 1)
    with open(path, "rb") as f:
        for _, start, length in ranges:
            f.seek(start)
            parts = []
            left = length
            while True:
                n = min(left, len(buf))
                view = memoryview(buf)[:n]
                got = f.readinto(view) if n else 0
                if got != n:
                    raise _damaged(path, f"it ends inside the entry at byte {start} (truncated)")
                chunk = torch.frombuffer(buf, dtype=torch.uint8, count=n) if n else None
                parts.append(
                    0 if chunk is None else int(checkpoint_ops.tensor_digest([chunk]).item())
                )
                left -= n
                if left == 0:
                    break
            # Several chunks: the digest of their digests (a range longer than the buffer).
            if len(parts) == 1:
                out.append(parts[0] & _MASK)
            else:
                h = hashlib.blake2b(digest_size=8)
                for p in parts:
                    h.update((p & _MASK).to_bytes(8, "little"))
                out.append(int.from_bytes(h.digest(), "little"))
    return out


def _tile(entries: list[tuple[str, int, int]], size: int) -> list[tuple[str, int, int]]:
    """``entries`` plus the ranges between and after them, so that every byte is in one."""
    out, pos = [], 0
    for name, start, length in entries:
        if start > pos:
            out.append((f"(bytes {pos}..{start} between entries)", pos, start - pos))
        out.append((name, start, length))
        pos = max(pos, start + length)
    if size > pos:
        out.append((f"(bytes {pos}..{size} after the entries)", pos, size - pos))
    return out


def _mine(names: list[str], rank: int, world: int) -> list[str]:
    return [n for i, n in enumerate(sorted(names)) if i % world == rank]


def file_digests(folder: str, rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Digests of this rank's share of the files in the torch.distributed.checkpoint directory
    ``folder`` (every rank calls it after the save; the union over ranks covers every file):
    file name -> ``{"size": bytes, "entries": [[entry, offset, length, digest], ...]}``."""
    layout = _layout(folder)
    layout[".metadata"] = []
    out: dict[str, dict[str, Any]] = {}
    for name in _mine(list(layout), rank, world):
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        entries = _tile(layout[name], size) if name != ".metadata" else [("(metadata)", 0, size)]
        digests = _digest_ranges(path, entries)
        out[name] = {
            "size": size,
            "entries": [[e, s, n, d] for (e, s, n), d in zip(entries, digests)],
        }
    return out


def verify_files(
    recorded: Mapping[str, Any], folder: str, where: str, rank: int, world: int
) -> None:
    """Checks this rank's share of the files ``recorded`` by :func:`file_digests` (sizes, then each
    entry's digest); raises :class:`ChecksumError` naming the file and the entry."""
    for name in _mine(list(recorded), rank, world):
        rec = recorded[name]
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"load_training_state: {path!r} (a file of the sharded tensors of {where}) does "
                "not exist; the checkpoint directory is incomplete. Resume from another checkpoint"
            )
        size = os.path.getsize(path)
        if size != rec["size"]:
            why = f"it has {size} bytes, the save wrote {rec['size']} (truncated or replaced)"
            raise _damaged(path, why)
        entries = [(e, s, n) for e, s, n, _ in rec["entries"]]
        for (entry, _, _), want, got in zip(
            entries, [d for *_, d in rec["entries"]], _digest_ranges(path, entries)
        ):
            if got != want:
                raise _damaged(
                    path,
                    f"the checksum of its entry {entry!r} is {_hex(got)}, the save recorded "
                    f"{_hex(want)}",
                )
