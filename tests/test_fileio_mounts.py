"""The mount table: which file system a path is on, from /proc/self/mounts."""

from __future__ import annotations

from pathlib import Path

from distdiag.shim import mounts

TABLE = r"""sysfs /sys sysfs rw 0 0
/dev/sda1 / ext4 rw,relatime 0 0
tmpfs /tmp tmpfs rw 0 0
10.0.0.1@o2ib:/scratch /scratch lustre rw 0 0
server:/home /home nfs4 rw 0 0
slowfs /tmp/my\040mount fuse.slowfs rw 0 0
/dev/sdb1 /scratch/local xfs rw 0 0
tmpfs /tmp tmpfs rw,size=1G 0 0
"""


def table() -> mounts.MountTable:
    return mounts.MountTable(mounts.parse_mounts(TABLE))


def test_longest_prefix_wins_and_boundaries_respected() -> None:
    t = table()
    assert t.lookup("/scratch/proj/a.h5") == ("lustre", "/scratch")
    assert t.lookup("/scratch/local/x") == ("xfs", "/scratch/local")
    assert t.lookup("/scratchy/x") == ("ext4", "/")  # a prefix of the name is not a parent dir
    assert t.lookup("/home/u/.bashrc") == ("nfs4", "/home")
    assert t.lookup("/usr/lib/python3/x.py") == ("ext4", "/")


def test_mount_point_itself_belongs_to_the_mounted_fs() -> None:
    t = table()
    assert t.lookup("/scratch") == ("lustre", "/scratch")
    assert t.lookup("/scratch/local") == ("xfs", "/scratch/local")


def test_escaped_spaces_and_shadowing() -> None:
    t = table()
    assert t.lookup("/tmp/my mount/f") == ("fuse.slowfs", "/tmp/my mount")
    assert t.lookup("/tmp/other") == ("tmpfs", "/tmp")


def test_relative_paths_resolve_against_cwd_lexically(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    t = mounts.MountTable([("/", "ext4"), (str(tmp_path), "fuse.x")])
    monkeypatch.chdir(tmp_path)
    assert t.lookup("a/../b") == ("fuse.x", str(tmp_path))


def test_real_table_knows_root_and_proc() -> None:
    mounts.refresh()
    assert mounts.lookup("/proc/self/status")[0] == "proc"
    assert mounts.fs_tag("/").endswith(":/")
