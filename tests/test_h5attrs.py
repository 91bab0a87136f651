"""The root attributes decoded from the header's bytes (distdiag.h5attrs) read as h5py reads them."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from distdiag import h5attrs
from distdiag.run import _attr, _Attrs, _Heap, _open_h5, load_run
from factories import make_run

#: one value of each kind the shim writes (ints, floats, booleans, text, and bytes: h5py's ASCII text)
SHIM_KINDS: dict[str, Any] = {
    "i": -3, "big": 2**63 - 1, "f": 1.5, "nan": float("nan"), "yes": True, "no": False,
    "s": "héllo", "empty": "", "json": '{"a": [1, 2]}', "b": b"xy",
}  # fmt: skip


def _image(attrs: dict[str, Any]) -> bytes:
    b = io.BytesIO()
    with h5py.File(b, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
    return b.getvalue()


def _pread(data: bytes) -> Any:
    return lambda at, n: data[at : at + n]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    return type(a) is type(b) and a == b


def test_every_encoding_the_shim_writes_is_decoded_from_the_header() -> None:
    # h5py writes each kind with one of ENCODINGS (a new h5py that wrote another would leave
    # them to libhdf5, slower: this says so)
    data = _image(SHIM_KINDS)
    got = h5attrs.root_attributes(_pread(data), len(data))
    assert got is not None
    assert got.names == {k.encode() for k in SHIM_KINDS}
    assert set(got.values) | set(got.strings) == set(SHIM_KINDS)
    with h5py.File(io.BytesIO(data), "r") as f:
        for k, v in got.values.items():
            want = f.attrs[k]
            assert type(v) is type(want) and (v == want or (np.isnan(v) and np.isnan(want))), k


@pytest.mark.parametrize("native", [True, False])
def test_attrs_read_as_h5py_reads_them_also_those_left_to_libhdf5(tmp_path: Path, native: bool) -> None:
    # the shim's kinds come from the header; an array, an int32, a fixed-length string and an
    # empty dataspace are left to libhdf5, by name; both ways give what h5py's attrs.get gives
    odd = {"arr": np.arange(3), "i32": np.int32(5), "fixed": np.bytes_(b"abc"), "none": h5py.Empty("f8")}
    p = tmp_path / "a.h5"
    p.write_bytes(_image({**SHIM_KINDS, **odd}))
    f = _open_h5(p)
    try:
        heap = _Heap.of(f)
        a = _Attrs(f, heap if native else None)
        assert (a._native is not None) == native
        for k in [*SHIM_KINDS, "i32", "fixed", "absent"]:
            assert _same(_attr(a, k, "dflt"), _attr(f.attrs, k, "dflt")), k
        assert list(a.get("arr")) == [0, 1, 2]
        if native:
            assert not set(odd) & (set(a._native.values) | set(a._native.strings))  # type: ignore[union-attr]
    finally:
        f.close()


def test_a_shim_written_rank_file_reads_its_attributes_from_the_header(tmp_path: Path) -> None:
    make_run(tmp_path / "r", iters=5)
    p = sorted((tmp_path / "r").glob("rank-*.h5"))[1]
    f = _open_h5(p)
    try:
        a = _Attrs(f, _Heap.of(f))
        nat = a._native
        assert nat is not None
        names = [n.decode() for n in nat.names]
        assert "rank" in names and "host" in names and "closed_cleanly" in names
        assert set(names) == set(nat.values) | set(nat.strings)  # none left to libhdf5
        for k in names:
            assert _same(_attr(a, k), _attr(f.attrs, k)), k
    finally:
        f.close()
    run = load_run(tmp_path / "r")
    assert run.ranks[1].host == "node0" and run.warnings == []


def _attr_message_at(data: bytes, name: bytes) -> int:
    at = data.find(name + b"\x00")
    assert at > 0
    return at - 8  # the message's data begins 8 bytes before the name (version-1 attribute message)


def test_a_name_twice_or_a_newer_format_leaves_every_attribute_to_libhdf5() -> None:
    data = _image({"aa": 1, "ab": 2})
    twice = data.replace(b"ab\x00", b"aa\x00")
    assert h5attrs.root_attributes(_pread(data), len(data)) is not None
    assert h5attrs.root_attributes(_pread(twice), len(twice)) is None
    b = io.BytesIO()
    with h5py.File(b, "w", libver="latest") as f:  # superblock 3, version-2 headers, dense storage past 8
        for i in range(12):
            f.attrs[f"a{i}"] = i
    newer = b.getvalue()
    assert h5attrs.root_attributes(_pread(newer), len(newer)) is None


def test_text_in_a_damaged_heap_collection_reads_as_absent(tmp_path: Path) -> None:
    # the collection the text attributes point at fails gheap's walk: libhdf5 must not decode it,
    # so they read as absent (and the heap says why), the numbers are still read
    data = bytearray(_image({"n": 7, "s": "text"}))
    col = bytes(data).find(b"GCOL")
    assert col > 0
    data[col + 8 : col + 16] = (10**9).to_bytes(8, "little")  # a size past the file's end
    p = tmp_path / "d.h5"
    p.write_bytes(bytes(data))
    f = _open_h5(p)
    try:
        heap = _Heap.of(f)
        a = _Attrs(f, heap)
        assert _attr(a, "n") == 7
        assert _attr(a, "s", "absent") == "absent"
        assert "claims" in heap.damaged
    finally:
        f.close()


def test_the_header_is_read_with_a_bounded_count_of_preads(tmp_path: Path) -> None:
    data = _image(SHIM_KINDS)
    calls = []

    def pread(at: int, n: int) -> bytes:
        calls.append(n)
        return data[at : at + n]

    assert h5attrs.root_attributes(pread, len(data)) is not None
    assert len(calls) <= 8 and sum(calls) <= len(data) + 4096
    assert h5attrs.root_attributes(_pread(data[:50]), 50) is None  # cut inside the superblock
    assert h5attrs.root_attributes(_pread(b""), 0) is None
