"""A tokenized corpus on disk: one file, a 32-byte header then the tokens, memory-mapped.

    write_tokens("corpus.tokens", ids)            # ids: an int array, or an iterable of them
    corpus = TokenFile("corpus.tokens")           # len(corpus) tokens, never read whole
    window = corpus.read(1000, 1065)              # int64 tokens 1000..1064, 65 * itemsize bytes

The header: b"APTOKENS", the format version (uint32, 1), the dtype's name in 12 ASCII bytes
(`uint16` or `uint32`, NUL-padded) and the token count (uint64), little-endian. The header
makes a file self-describing (nanoGPT's raw .bin files need the dtype told apart), and lets a
truncated or foreign file be refused before a step reads garbage. `read` counts the bytes it
copies out of the map (`bytes_read`): the benchmark's figure of what a rank asks of storage.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

from autopart.errors import AutopartError

MAGIC = b"APTOKENS"
VERSION = 1
_HEADER = struct.Struct("<8sI12sQ")     # magic, version, dtype name, token count
HEADER_BYTES = _HEADER.size             # 32
DTYPES = ("uint16", "uint32")


def _dtype_for(tokens: np.ndarray, dtype: str | None) -> str:
    top = int(tokens.max()) if tokens.size else 0
    if dtype is None:
        return "uint16" if top < 2 ** 16 else "uint32"
    if dtype not in DTYPES:
        raise AutopartError(f"write_tokens: dtype={dtype!r} is not one of {DTYPES}.\n  remedy: "
                            "uint16 for vocabularies up to 65536, uint32 above")
    if top >= 2 ** (8 * np.dtype(dtype).itemsize):
        raise AutopartError(f"write_tokens: token id {top} does not fit {dtype}.\n  remedy: "
                            "write_tokens(..., dtype='uint32')")
    return dtype


def _as_ids(chunk) -> np.ndarray:
    a = np.asarray(chunk.cpu() if hasattr(chunk, "cpu") else chunk)
    if a.dtype.kind not in "iu":
        raise AutopartError(f"write_tokens: tokens of dtype {a.dtype} are not integer ids.\n  "
                            "remedy: pass the tokenizer's integer ids")
    a = a.reshape(-1)
    if a.size and int(a.min()) < 0:
        raise AutopartError(f"write_tokens: a negative token id ({int(a.min())}).\n  remedy: "
                            "token ids are >= 0; drop padding or ignore labels (-100) first")
    return a


def write_tokens(path: str | os.PathLike, tokens, dtype: str | None = None) -> Path:
    """Write `tokens` as a token file: an integer array, tensor or list of ids, or an iterator of
    such chunks (streamed, for a corpus larger than memory). `dtype` is uint16 or uint32; unset,
    uint16 when every id fits (an iterator's chunks are checked against uint16 as they come).
    Atomic: the file appears complete or not at all. Returns its path."""
    path = Path(path)
    single = hasattr(tokens, "shape") or isinstance(tokens, (list, tuple))
    chunks: Iterable = [tokens] if single else tokens
    part = path.with_name(path.name + ".part")
    count, chosen = 0, dtype or "uint16"
    try:
        with open(part, "wb") as f:
            f.write(b"\0" * HEADER_BYTES)       # the header goes in last, once the count is known
            for chunk in chunks:
                ids = _as_ids(chunk)
                chosen = _dtype_for(ids, dtype or (None if single else "uint16"))
                f.write(ids.astype(chosen).tobytes())
                count += ids.size
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, VERSION, chosen.encode(), count))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    os.replace(part, path)
    return path


class TokenFile:
    """A token file, memory-mapped read-only. `read(start, stop)` copies tokens out as int64 and
    adds their bytes on disk to `bytes_read`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.dtype, self.tokens = _read_header(self.path)
        self.itemsize = np.dtype(self.dtype).itemsize
        self._map = _mapped(self.path, self.dtype, self.tokens)
        self.bytes_read = 0

    def __len__(self) -> int:
        return self.tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.tokens:
            raise AutopartError(f"{self.path}: tokens {start}..{stop} are outside its "
                                f"{self.tokens} tokens")
        self.bytes_read += (stop - start) * self.itemsize
        return np.array(self._map[start:stop], dtype=np.int64)

    def describe(self) -> dict:
        """What a loader's state records of the corpus, to refuse resuming on another one."""
        return {"tokens": self.tokens, "dtype": self.dtype}


def _mapped(path: Path, dtype: str, count: int) -> np.ndarray:
    """The tokens as a read-only array over a memory map of the file. Told MADV_RANDOM: windows
    are read in a permuted order, and the kernel's read-ahead around each page fault (8 MiB on
    this machine's disk) made the storage read ~900x the bytes a rank needs (bench/data_bytes.py:
    38 MB for 20 windows of 2 KB; 119 KB with the advice)."""
    if count == 0:
        return np.zeros(0, dtype)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=HEADER_BYTES)


def _read_header(path: Path) -> tuple[str, int]:
    if not path.is_file():
        raise AutopartError(f"token file {path} does not exist.\n  remedy: write one with "
                            "autopart.data.write_tokens(path, ids) (examples/train_llama.py "
                            "--make-corpus writes one)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise AutopartError(f"{path} is not an autopart token file (its first bytes are "
                            f"{head[:8]!r}, not {MAGIC!r}).\n  remedy: write it with "
                            "autopart.data.write_tokens(path, ids)")
    _, version, name, count = _HEADER.unpack(head)
    dtype = name.rstrip(b"\0").decode("ascii", "replace")
    if version != VERSION:
        raise AutopartError(f"{path}: token file format version {version}; this autopart reads "
                            f"version {VERSION}.\n  remedy: rewrite it with write_tokens")
    if dtype not in DTYPES:
        raise AutopartError(f"{path}: its header says dtype {dtype!r}, not one of {DTYPES}.\n  "
                            "remedy: rewrite it with autopart.data.write_tokens(path, ids, "
                            "dtype='uint16' or 'uint32')")
    expected = HEADER_BYTES + count * np.dtype(dtype).itemsize
    if size != expected:
        raise AutopartError(f"{path}: its header says {count} {dtype} tokens ({expected} bytes "
                            f"with the header), the file has {size} bytes: truncated or "
                            "appended to.\n  remedy: rewrite it with write_tokens")
    return dtype, count
