"""A rank file's root attributes, decoded from the bytes of its root group's object header.

h5py reads an attribute with five or six libhdf5 calls (open by name, which walks the
header's messages; its type, class and space; the read): 25-40 us each, and a rank file
holds 21-28 of them, so about 0.6 ms of the 2.5-3 ms a rank file took to load (1,024 rank
files: 0.6 s). The shim writes its attributes as scalars of five encodings: 64-bit
integers, doubles, h5py's boolean enum and variable-length strings (UTF-8, or ASCII where
the value was ``bytes``), in the root group's version-1 object header (superblock version 0:
the default file format, which the shim writes). :func:`root_attributes` reads that header with
``pread`` and the bounds of :mod:`distdiag.h5guard` and decodes each attribute message whose
datatype is byte for byte one of those encodings (:data:`ENCODINGS`) and whose dataspace is
scalar. Anything else is left to libhdf5, name by name (:class:`distdiag.run._Attrs`): another
type or shape, a shared message, a name it cannot read. A file whose names are not each
plainly one message (a name twice, an attribute info message of dense storage, a malformed
message) is left to libhdf5 whole: None.

A string's bytes come from its global heap collection, walked by :mod:`distdiag.gheap`
(never by libhdf5) as the string table's are. They read as h5py reads them: up to the
first NUL (a C string), decoded as UTF-8 with bytes that are not kept as escapes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from distdiag import h5guard

#: The attribute message (HDF5 file format, IV.A.2.m) and the messages that mean the attributes
#: are not all in the header (attribute info: dense storage).
_ATTRIBUTE = 0x000C
_ATTRIBUTE_INFO = 0x0015
#: A version-1 dataspace message of a scalar: version 1, no dimensions, no flags, 5 reserved bytes.
_SCALAR = bytes.fromhex("0100000000000000")

#: The datatype messages the shim's attributes have, as h5py writes them (``tests/test_h5attrs.py``
#: checks each against what h5py writes now), and how each one's bytes decode.
ENCODINGS: dict[bytes, str] = {
    bytes.fromhex("100800000800000000004000"): "int64",  # fixed-point, signed, little-endian, 8 bytes
    bytes.fromhex("11203f000800000000004000340b0034ff030000"): "float64",  # IEEE little-endian double
    bytes.fromhex("180200000100000010080000010000000000080046414c534500000054525545000000000001"): "bool",
    bytes.fromhex("1901010010000000100000000100000000000800"): "vlen",  # variable-length string, UTF-8
    bytes.fromhex("1901000010000000100000000100000000000800"): "vlen",  # variable-length string, ASCII
}

#: a variable-length string's reference: its length, its collection's address, its index there
_VLEN = struct.Struct("<IQI")


@dataclass
class RootAttributes:
    """The root group's attributes as the header holds them: every name (as libhdf5 lists
    them), the values decoded here (numpy scalars, as h5py reads them), and the strings'
    references (length, collection address, index) for the heap to resolve."""

    names: frozenset[bytes]
    values: dict[str, Any] = field(default_factory=dict)
    strings: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def root_attributes(pread: Callable[[int, int], bytes], size: int) -> RootAttributes | None:
    """The root group's attributes of the HDF5 file whose bytes ``pread(offset, n)`` reads (``size``
    bytes in all), or None where the header is not plainly the shim's layout (see the module
    docstring): then libhdf5 reads them all."""
    f = h5guard.Bounded(pread, size)
    try:
        sb = f.read(0, 96)
        if len(sb) < 96 or sb[:8] != h5guard.SIGNATURE or sb[8] != 0 or sb[13] != 8 or sb[14] != 8:
            return None  # not superblock version 0 with 8-byte addresses and lengths
        if h5guard.u64(sb, 24) != 0:
            return None  # a user block: addresses are relative to it
        messages = h5guard.header_messages(f, h5guard.u64(sb, 24 + 32 + 8), "the root group")
    except h5guard.UnsafeHeader:
        return None
    if messages is None:
        return None
    names: list[bytes] = []
    out = RootAttributes(frozenset())
    for mtype, flags, data in messages:
        if mtype == _ATTRIBUTE_INFO:
            return None  # dense storage: attributes outside the header
        if mtype != _ATTRIBUTE:
            continue
        if len(data) < 8 or data[0] != 1:
            return None  # not a version-1 attribute message: its name cannot be read here
        n_name, n_type, n_space = struct.unpack_from("<HHH", data, 2)
        raw = data[8 : 8 + n_name]
        if n_name < 2 or len(raw) < n_name or raw[-1] != 0 or 0 in raw[:-1]:
            return None  # a name that is not one plain C string
        name = raw[:-1]
        names.append(name)
        if flags:
            continue  # a shared or constant message: libhdf5's to read
        at = 8 + _pad8(n_name)
        dtype = data[at : at + n_type]
        at += _pad8(n_type)
        space = data[at : at + n_space]
        at += _pad8(n_space)
        how = ENCODINGS.get(bytes(dtype))
        if how is None or bytes(space) != _SCALAR:
            continue  # another type, or not a scalar: libhdf5's to read
        value = data[at : at + (16 if how == "vlen" else 1 if how == "bool" else 8)]
        key = name.decode("utf-8", "surrogateescape")
        if how == "vlen":
            if len(value) == 16:
                length, addr, idx = _VLEN.unpack(value)
                if addr:  # a null reference: libhdf5's to read
                    out.strings[key] = (length, addr, idx)
        elif how == "bool":
            if len(value) == 1 and value[0] in (0, 1):
                out.values[key] = np.bool_(value[0] == 1)
        elif len(value) == 8:
            out.values[key] = np.frombuffer(value, "<i8" if how == "int64" else "<f8")[0]
    if len(set(names)) != len(names):
        return None  # a name twice: which one libhdf5 opens is its business
    out.names = frozenset(names)
    return out


def _pad8(n: int) -> int:
    return (n + 7) & ~7
