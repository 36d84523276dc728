"""Files of :mod:`fastamp.resume`: atomic writes that report the real OSError, and the encoding of
the user's ``extra`` items so that ``torch.load(weights_only=True)`` reads them back."""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import pathlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch


class _WriteRecorder:
    """A binary file that remembers the OSError its write raised: torch.save reports a failed
    write as ``RuntimeError: [enforce fail at inline_container.cc...]``, which hides ENOSPC."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.error: OSError | None = None

    def write(self, b: bytes) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = e
            raise


def _write_error(path: str, e: OSError) -> OSError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OSError(
            e.errno,
            f"save_training_state: the disk is full: could not write {path!r} ({e.strerror}). "
            "Nothing was replaced (the previous checkpoint, if any, is intact) and no temporary "
            "file was left; free space or save elsewhere",
        )
    return OSError(e.errno, f"save_training_state: could not write {path!r}: {e.strerror}")


# torch.save's CRC-32 of every record: the largest share of its time on a CPU (a single-threaded
# pass over every byte, ~1-2 GB/s), and checked by no reader of the file (torch.load skips it).
# A file that carries fastamp's own checksums, verified at load, is written without it
# (torch.serialization.set_crc32_options(False); zip tools then report the records' CRC as
# wrong). The option is process-wide and read when torch.save opens its writer: it is off while
# at least one such save runs, and put back as it was after the last one (a torch.save in another
# thread meanwhile writes no CRC-32 either; torch.load reads its file as usual).
_crc32_lock = threading.Lock()
_crc32_off_count = 0
_crc32_before = True


@contextlib.contextmanager
def _torch_crc32_off() -> Iterator[None]:
    global _crc32_off_count, _crc32_before
    with _crc32_lock:
        if _crc32_off_count == 0:
            _crc32_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc32_off_count += 1
    try:
        yield
    finally:
        with _crc32_lock:
            _crc32_off_count -= 1
            if _crc32_off_count == 0:
                torch.serialization.set_crc32_options(_crc32_before)


def atomic_save(obj: Any, path: str, *, torch_crc32: bool = True) -> None:
    """torch.save to a temporary file of a unique name beside ``path`` (several threads or
    processes may save at once), fsync, then rename over ``path``. On any failure the temporary
    file is removed and ``path`` is left as it was. ``torch_crc32=False``: without torch.save's
    CRC-32 of the records (for a file whose content fastamp's checksums cover and verify)."""
    if os.path.isdir(path):
        raise IsADirectoryError(
            errno.EISDIR,
            f"save_training_state: path {path!r} is a directory; expected a file name (e.g. "
            f"{os.path.join(path, 'checkpoint.pt')!r})",
        )
    directory = os.path.dirname(os.path.abspath(path))
    # A name of its own per save (threads of one process included), created exclusively, with the
    # permissions torch.save would give the file (mkstemp would make it 0600).
    tmp = os.path.join(
        directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            rec = _WriteRecorder(f)
            try:
                # torch.save writes to any object with write() and flush() (as its docstring
                # says); its annotation names only str, PathLike and IO[bytes]
                with contextlib.nullcontext() if torch_crc32 else _torch_crc32_off():
                    torch.save(obj, rec)  # type: ignore[arg-type]
                rec.flush()
                os.fsync(f.fileno())
            except OSError as e:
                raise _write_error(path, rec.error or e) from e
            except RuntimeError as e:
                if rec.error is not None:
                    raise _write_error(path, rec.error) from e
                raise
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------- extra: types beyond weights_only
# torch.load(weights_only=True) reads tensors, numbers, strings, bytes, None and lists / tuples /
# dicts of them, and nothing else. Common run metadata that is none of these is stored as a
# tagged dict of such values and rebuilt on load; anything else is refused at save time (a
# checkpoint that load_training_state cannot read would be discovered only at resume).
_TAG = "__fastamp_extra_type__"


def encode_extra(value: Any, where: str) -> Any:
    # Exact types: numpy's float64 subclasses float, an IntEnum int -- neither loads back.
    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return value
    if isinstance(value, (torch.Tensor, torch.dtype, torch.device, torch.Size)):
        return value
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        pass
    else:
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject or value.dtype.fields is not None:
                raise TypeError(
                    f"save_training_state: {where} is a numpy array of dtype {value.dtype}, "
                    "which torch.load(weights_only=True) cannot read back; expected a numeric "
                    "array (or convert it: arr.tolist())"
                )
            return {
                _TAG: "numpy.ndarray",
                "dtype": value.dtype.str,
                "shape": list(value.shape),
                "data": np.ascontiguousarray(value).tobytes(),
            }
        if isinstance(value, np.generic):
            if isinstance(value, (np.bool_, np.number)):
                return {_TAG: "numpy.scalar", "dtype": value.dtype.str, "data": value.tobytes()}
            raise TypeError(
                f"save_training_state: {where} is a numpy {type(value).__name__}, which "
                "torch.load(weights_only=True) cannot read back; expected a number "
                "(value.item())"
            )
    if isinstance(value, pathlib.PurePath):
        kind = (
            "pathlib.PureWindowsPath"
            if isinstance(value, pathlib.PureWindowsPath) and not isinstance(value, pathlib.Path)
            else "pathlib.Path"
        )
        return {_TAG: kind, "path": str(value)}
    if isinstance(value, argparse.Namespace):
        return {_TAG: "argparse.Namespace", "vars": encode_extra(vars(value), f"vars({where})")}
    if isinstance(value, OrderedDict):
        return OrderedDict((k, encode_extra(v, f"{where}[{k!r}]")) for k, v in value.items())
    if isinstance(value, dict):
        if _TAG in value:
            raise ValueError(f"save_training_state: {where} uses the reserved key {_TAG!r}")
        for k in value:
            if not (k is None or isinstance(k, (bool, int, float, str, bytes))):
                raise TypeError(
                    f"save_training_state: {where} has a key {k!r} of type {type(k).__name__}; "
                    "torch.load(weights_only=True) reads dicts keyed by str, int, float, bool, "
                    "bytes or None"
                )
        return {k: encode_extra(v, f"{where}[{k!r}]") for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(encode_extra(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, (set, frozenset)):
        raise TypeError(
            f"save_training_state: {where} is a {type(value).__name__}, which "
            "torch.load(weights_only=True) cannot read back; expected a list (sorted(s))"
        )
    raise TypeError(
        f"save_training_state: {where} is a {type(value).__module__}.{type(value).__qualname__}, "
        "which torch.load(weights_only=True) cannot read back, so the run could not be resumed. "
        "Expected numbers, strings, bytes, None, tensors, numpy arrays and scalars, pathlib paths, "
        "argparse.Namespace, and lists / tuples / dicts of them: convert it (e.g. to a dict of "
        "such values)"
    )


def decode_extra(value: Any) -> Any:
    if isinstance(value, dict):
        tag = value.get(_TAG)
        if tag == "numpy.ndarray":
            import numpy as np

            flat = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"]))
            return flat.reshape(value["shape"]).copy()
        if tag == "numpy.scalar":
            import numpy as np

            return np.frombuffer(value["data"], dtype=np.dtype(value["dtype"]))[0]
        if tag == "pathlib.Path":
            return pathlib.Path(value["path"])
        if tag == "pathlib.PureWindowsPath":
            return pathlib.PureWindowsPath(value["path"])
        if tag == "argparse.Namespace":
            return argparse.Namespace(**decode_extra(value["vars"]))
        out = {k: decode_extra(v) for k, v in value.items()}
        return OrderedDict(out) if isinstance(value, OrderedDict) else out
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(decode_extra(v) for v in value)
    return value


def check_weights_only(obj: Any, what: str) -> None:
    """Refuses, at save time, what torch.load(weights_only=True) would refuse at load time."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as e:  # the unpickler's error names the offending global
        lines = str(e).splitlines()
        why = next((ln.strip() for ln in lines if "Unsupported" in ln), lines[0] if lines else "")
        raise TypeError(
            f"save_training_state: {what} holds an object that torch.load(weights_only=True) "
            f"cannot read back, so the run could not be resumed ({why[:300]}); expected plain "
            "data (numbers, strings, tensors, lists, dicts)"
        ) from None
