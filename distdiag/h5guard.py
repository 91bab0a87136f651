"""The sizes a rank file's HDF5 headers declare, checked against the file before libhdf5 reads them.

A run dir is untrusted input, and the shim's files carry no checksums: HDF5's version-0
superblock and version-1 object headers (the default file format, which the shim writes)
have none. libhdf5 allocates what a header declares before it reads it, and finds out
that the bytes are not there only after: one flipped byte in the length of the root
group's header continuation made it allocate and fill 721 MB while *opening* the file,
and segfault where the allocation failed under a memory bound; another made the root
group's name heap's free list loop, and libhdf5 allocated a node per turn until memory ran
out (``benchmarks/fuzz_rundirs.py --flips``: seeds 8273, 12019 and 13576 at byte 131 of the
file, the continuation's length; seed 15919 at byte 776, the free list's first link).

:func:`check` walks the structures libhdf5 reads when it opens the file and its
top-level tables, each read with ``pread`` and bounded: the superblock, the object
headers of the root group and of each object the root group lists (their first chunk
and every continuation chunk), the root group's local heap, and its B-tree and symbol
table nodes. Each size that libhdf5 would allocate must fit inside the file; a size
that does not is :class:`UnsafeHeader`, and the file is skipped with that line
(as a truncated file is), never handed to libhdf5.

What it leaves to libhdf5: everything that is not a size it allocates by (versions,
signatures, message contents: libhdf5 refuses those itself, before any allocation), files of
a newer format (superblock version 2 and 3, whose headers carry checksums that libhdf5
verifies), and objects deeper than the root group's own (the shim writes none).
"""

from __future__ import annotations

import os
import struct
from typing import Callable

#: HDF5's file signature
SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: the most object headers, B-tree nodes and header chunks one check reads (the shim's files
#: hold 5 tables: ~22 reads)
MAX_READS = 4096
#: object header message types (HDF5 file format, IV.A.2)
_CONTINUATION = 0x0010
_SYMBOL_TABLE = 0x0011


class UnsafeHeader(ValueError):
    """A header of the file declares a size that does not fit inside the file: libhdf5 would
    allocate it unchecked. The message says which header and where."""


class Bounded:
    """A file's bytes as ``pread(offset, n)`` reads them, ``size`` in all, read a bounded number of times."""

    def __init__(self, pread: Callable[[int, int], bytes], size: int) -> None:
        self.pread = pread
        self.size = size
        self.reads = 0

    def read(self, addr: int, n: int) -> bytes:
        """``n`` bytes at ``addr``, or fewer where the file ends (a bounded count of reads)."""
        self.reads += 1
        if self.reads > MAX_READS:
            raise UnsafeHeader(f"more than {MAX_READS} headers to read (a loop of addresses?)")
        if addr < 0 or addr >= self.size or n <= 0:
            return b""
        return self.pread(addr, min(n, self.size - addr))

    def fits(self, addr: int, n: int) -> bool:
        return 0 <= addr and 0 <= n and addr + n <= self.size


def check(fd: int, size: int) -> None:
    """Raise :class:`UnsafeHeader` where a size the headers of the HDF5 file open as ``fd``
    (of ``size`` bytes) declare does not fit inside it; return quietly otherwise, also for
    what this does not read (see the module docstring). Reads at most a few kB a table."""
    f = Bounded(lambda at, n: os.pread(fd, n, at), size)
    sb = f.read(0, 128)
    if len(sb) < 24 or sb[:8] != SIGNATURE:
        return  # no signature at 0 (a user block, or not HDF5): libhdf5's call
    version, size_o, size_l = sb[8], sb[13], sb[14]
    if version not in (0, 1) or size_o != 8 or size_l != 8:
        return  # a newer, checksummed format, or sizes the shim never writes
    at = 24 if version == 0 else 28
    if len(sb) < at + 32 + 40:
        return
    base, stored_eof = u64(sb, at), u64(sb, at + 16)
    root = sb[at + 32 : at + 72]  # the root group's symbol table entry
    header = u64(root, 8)
    if base != 0:
        return  # a user block: addresses are relative to it, libhdf5's call
    if stored_eof > size:
        return  # truncated: libhdf5 says so ("N of M bytes present") before it reads a header
    children = _object_header(f, header, "the root group")
    if children is None:
        return
    btree, heap = children
    _local_heap(f, heap)
    for i, addr in enumerate(_group_entries(f, btree)):
        _object_header(f, addr, f"object {i} of the root group")


def u64(b: bytes, at: int) -> int:
    v: int = struct.unpack_from("<Q", b, at)[0]
    return v


def _object_header(f: Bounded, addr: int, what: str) -> tuple[int, int] | None:
    """Check the version-1 object header at ``addr``: its first chunk and each continuation
    chunk must fit in the file. Returns its symbol table message's (B-tree, local heap)
    addresses, or None."""
    messages = header_messages(f, addr, what)
    if messages is None:
        return None
    table: tuple[int, int] | None = None
    for mtype, _, data in messages:
        if mtype == _SYMBOL_TABLE and len(data) >= 16:
            table = (u64(data, 0), u64(data, 8))
    return table


def header_messages(f: Bounded, addr: int, what: str) -> list[tuple[int, int, bytes]] | None:
    """The messages (type, flags, data) of the version-1 object header at ``addr``, of its first
    chunk and of each continuation chunk, each chunk read once; None where there is no
    version-1 header. Raises :class:`UnsafeHeader` where a chunk does not fit in the file."""
    pre = f.read(addr, 16)
    if len(pre) < 16 or pre[0] != 1:
        return None  # past the end, or not a version-1 header: libhdf5 refuses it itself
    first = struct.unpack_from("<I", pre, 8)[0]
    if not f.fits(addr + 16, first):
        raise UnsafeHeader(f"{what}'s object header at byte {addr} declares {first} bytes, past the end of "
                           f"the file ({f.size} bytes)")  # fmt: skip
    chunks = [(addr + 16, first)]
    out: list[tuple[int, int, bytes]] = []
    seen = set()
    while chunks:  # per header chunk: the first, then each continuation
        start, n = chunks.pop()
        if start in seen:
            continue
        seen.add(start)
        buf = f.read(start, n)
        p = 0
        while p + 8 <= len(buf):  # per message: type, size, flags, 3 reserved bytes, data
            mtype, msize, flags = struct.unpack_from("<HHB", buf, p)
            data = buf[p + 8 : p + 8 + msize]
            if mtype == _CONTINUATION and len(data) >= 16:
                c_addr, c_len = u64(data, 0), u64(data, 8)
                if not f.fits(c_addr, c_len):
                    raise UnsafeHeader(f"{what}'s object header continues at byte {c_addr} with {c_len} bytes, past "
                                       f"the end of the file ({f.size} bytes)")  # fmt: skip
                chunks.append((c_addr, c_len))
            out.append((mtype, flags, data))
            p += 8 + msize
    return out


#: a local heap's "no free block" offset (H5HL_FREE_NULL)
_FREE_NULL = 1


def _local_heap(f: Bounded, addr: int) -> None:
    """The root group's local heap: its data segment must fit in the file, and its free list
    must end inside it. libhdf5 follows the list a node at a time and allocates each: a list
    that loops (one flipped byte made a block its own successor: seed 15919) allocates until
    memory runs out."""
    h = f.read(addr, 32)
    if len(h) < 32 or h[:4] != b"HEAP":
        return
    n, head, data = u64(h, 8), u64(h, 16), u64(h, 24)
    where = f"the root group's name heap at byte {addr}"
    if not f.fits(data, n):
        raise UnsafeHeader(f"{where} declares {n} bytes at byte {data}, past the end of the file ({f.size} bytes)")
    if head == _FREE_NULL:
        return
    seg = f.read(data, n)
    seen: set[int] = set()
    at = head
    while at != _FREE_NULL:  # per free block: (next block's offset, this block's size)
        if at in seen:
            raise UnsafeHeader(f"{where} has a free list that loops (block at offset {at} twice)")
        if at + 16 > len(seg):
            return  # outside the heap: libhdf5 refuses it ("bad heap free list") before allocating more
        seen.add(at)
        at = u64(seg, at)


def _group_entries(f: Bounded, btree: int) -> list[int]:
    """The object header addresses the group B-tree at ``btree`` lists (its symbol table nodes'
    entries), walked breadth first within :data:`MAX_READS`."""
    out: list[int] = []
    nodes = [btree]
    seen: set[int] = set()
    while nodes:  # per B-tree node
        addr = nodes.pop()
        if addr in seen:
            continue
        seen.add(addr)
        h = f.read(addr, 24)
        if len(h) < 24 or h[:4] != b"TREE" or h[4] != 0:
            continue
        level, used = h[5], struct.unpack_from("<H", h, 6)[0]
        body = f.read(addr + 24, 8 + used * 16)  # key 0, then (child, key) per entry
        for i in range(min(used, (len(body) - 8) // 16)):  # per child
            child = u64(body, 8 + 16 * i)
            if level > 0:
                nodes.append(child)
            else:
                out.extend(_symbol_node(f, child))
    return out


def _symbol_node(f: Bounded, addr: int) -> list[int]:
    """The object header addresses of a symbol table node's entries."""
    h = f.read(addr, 8)
    if len(h) < 8 or h[:4] != b"SNOD":
        return []
    n = struct.unpack_from("<H", h, 6)[0]
    body = f.read(addr + 8, 40 * n)
    return [u64(body, 40 * i + 8) for i in range(len(body) // 40)]
