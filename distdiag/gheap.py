"""A rank file's variable-length strings, decoded from its HDF5 global heap by distdiag.

libhdf5 decodes a global heap collection (``H5HG__cache_heap_deserialize``, in the
libhdf5 2.0.0 that h5py 3.16 bundles, as in every release before it) by stepping from
object to object by each object's declared size, with no check that the step moves
forward: one damaged size (0 for the free-space object, or one that wraps the pointer)
and the loop never ends, holding HDF5's global lock. ``tests/test_fuzz_reader.py`` found
it: about 1 rank file in 400 with random byte flips hung ``distdiag analyze`` for good.

So the reader never lets libhdf5 decode a heap that a rank file's string table points
at. It reads the table's 16-byte references itself (:func:`distdiag.run._vlen_refs`),
reads each collection they name with one ``pread``, walks it here under the rules of
the HDF5 format (signature ``GCOL``, version 1, a size of at least 4,096 bytes inside
the file, collections that do not overlap, every object inside its collection and its
step forward), and slices each string out of the bytes it walked. A string whose
collection or object fails a rule reads as "" and is counted; the others are kept.

Attributes that are variable-length strings live in the same collections (the shim
writes its text attributes before its first string). Their references are decoded from
the root group's header (:mod:`distdiag.h5attrs`) and their collections walked here too,
so a file with a damaged collection has those attributes read as absent
(:class:`distdiag.run._Attrs`): libhdf5 would decode the collection to read them.
"""

from __future__ import annotations

import struct
from typing import Callable

import numpy as np

#: H5HG_MINSIZE: libhdf5 makes no smaller collection, and reads this much of one first.
MIN_COLLECTION = 4096
#: A collection's header and an object's header (with 8-byte lengths, the shim's files).
_HDR = 16
_SIGNATURE = b"GCOL"
#: an object's header: its index, reference count and 4 reserved bytes, its size
_OBJ_HDR = struct.Struct("<H6xQ")
_VERSION = 1

#: The 16-byte reference a variable-length string's row holds in its chunk.
VLEN_REF = np.dtype([("len", "<u4"), ("addr", "<u8"), ("idx", "<u4")])


class Collection:
    """One walked collection: where each object's bytes begin (-1: no such object) and its size."""

    __slots__ = ("data", "begin", "size")

    def __init__(self, data: bytes, begin: np.ndarray, size: np.ndarray) -> None:
        self.data = data
        self.begin = begin
        self.size = size


def walk(addr: int, data: bytes) -> Collection | str:
    """The collection at file offset ``addr`` whose bytes are ``data`` (as its header's size
    says), or why libhdf5 must not decode it. One step per object (~0.2 us each): a
    collection holds at most a few thousand strings."""
    n = len(data)
    if n < _HDR or data[:4] != _SIGNATURE:
        return f"no global heap collection at byte {addr}"
    if data[4] != _VERSION:
        return f"a global heap collection at byte {addr} has version {data[4]}, not {_VERSION}"
    if int.from_bytes(data[8:16], "little") != n:
        return f"the global heap collection at byte {addr} is cut short"
    idxs: list[int] = []
    begins: list[int] = []
    sizes: list[int] = []
    unpack = _OBJ_HDR.unpack_from
    p = _HDR
    while p + _HDR <= n:  # a tail too small for a header is free space (as libhdf5 reads it)
        idx, sz = unpack(data, p)
        if idx == 0:  # the free space: its size counts its header and is not padded
            step = sz
            if step < _HDR:
                return f"the global heap collection at byte {addr} has a free-space object of {sz} bytes"
        else:
            step = _HDR + ((sz + 7) & ~7)
            idxs.append(idx)
            begins.append(p + _HDR)
            sizes.append(sz)
        if p + step > n:
            return f"object {idx} of the global heap collection at byte {addr} runs past its end"
        p += step
    keys = np.array(idxs, np.int64)
    top = int(keys.max()) + 1 if len(keys) else 1
    b = np.full(top, -1, np.int64)
    s = np.zeros(top, np.int64)
    b[keys] = begins
    s[keys] = sizes
    if len(np.unique(keys)) != len(keys):
        return f"the global heap collection at byte {addr} holds an object twice"
    return Collection(data, b, s)


def collections(addrs: list[int], pread: Callable[[int, int], bytes], file_size: int) -> tuple[dict[int, Collection], list[str]]:
    """The collections at ``addrs`` (unique, non-zero file offsets), each read and walked once,
    and why the others cannot be used. Collections may not overlap, so what is read is at
    most the file's size."""
    good: dict[int, Collection] = {}
    bad: list[str] = []
    end = 0
    for addr in sorted(set(addrs)):
        if addr < end:
            bad.append(f"the global heap collection at byte {addr} overlaps the one before it")
            continue
        if addr + _HDR > file_size:
            bad.append(f"a string points past the file's end (byte {addr})")
            continue
        head = pread(addr, MIN_COLLECTION)  # libhdf5's first read too: most are this size
        if len(head) < _HDR or head[:4] != _SIGNATURE:
            bad.append(f"no global heap collection at byte {addr}")
            continue
        n = int.from_bytes(head[8:16], "little")
        if n < MIN_COLLECTION or addr + n > file_size:
            bad.append(f"the global heap collection at byte {addr} claims {n} bytes (corrupt)")
            continue
        end = addr + n
        got = walk(addr, head if n == len(head) else pread(addr, n))
        if isinstance(got, str):
            bad.append(got)
        else:
            good[addr] = got
    return good, bad


def decode(refs: np.ndarray, good: dict[int, Collection], encoding: str) -> tuple[list[str], int]:
    """The strings ``refs`` (:data:`VLEN_REF` rows) name, and how many could not be read (they
    read as ""): a reference into a collection not in ``good``, to no object of it, or to one
    of another length. A null reference (address 0) is "", as libhdf5 reads it. Bytes that
    are not valid in ``encoding`` are replaced, never raised."""
    n = len(refs)
    addr = refs["addr"]
    idx = refs["idx"].astype(np.int64)
    length = refs["len"].astype(np.int64)
    start = np.full(n, -1, np.int64)
    which = np.zeros(n, np.int64)
    for k, (a, col) in enumerate(good.items()):
        rows = np.flatnonzero(addr == a)
        i = idx[rows]
        i = np.where((i > 0) & (i < len(col.begin)), i, 0)  # 0: never an object (begin -1)
        ok = (col.begin[i] >= 0) & (col.size[i] == length[rows])
        start[rows[ok]] = col.begin[i[ok]]
        which[rows[ok]] = k
    datas = [col.data for col in good.values()]
    damaged = int(np.count_nonzero((start < 0) & (addr != 0)))
    out: list[str] = [""] * n
    rows = np.flatnonzero(start >= 0)
    for r, w, lo, hi in zip(rows.tolist(), which[rows].tolist(), start[rows].tolist(), (start + length)[rows].tolist()):
        out[r] = datas[w][lo:hi].decode(encoding, "replace")
    return out, damaged
