"""Descriptors the shim made, checked to be still its own before each use.

A program may close every descriptor it did not open itself (a daemonizer's
``os.closerange(3, ...)``, ``subprocess``'s ``close_fds`` in a ``preexec_fn``
path, a C library's ``closefrom``) and then open files, pipes or sockets of
its own, which take the same numbers. A socket object of the shim still holds
the old number: used as it is, the shim would read the program's data, write
into its files and finally close them. So every socket the shim keeps is
remembered by its (device, inode) at creation and checked before each use; one
that is no longer ours is forgotten (``detach``: never closed by us) and its
work stops, as the shim's failures do, at no cost to the job.
"""

from __future__ import annotations

import os
import socket

Ident = tuple[int, int]


def ident(fd: int) -> Ident:
    """(device, inode) of ``fd``. Raises ``OSError``."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def fd_is(fd: int, mine: Ident | None) -> bool:
    """Whether descriptor number ``fd`` is still the file it was made as."""
    if mine is None or fd < 0:
        return False
    try:
        return ident(fd) == mine
    except OSError:
        return False


def still_ours(sock: socket.socket | None, mine: Ident | None) -> bool:
    """Whether ``sock``'s descriptor is still the socket it was made as."""
    return sock is not None and fd_is(sock.fileno(), mine)


def dup_above(fd: int, at_least: int) -> int:
    """``fd`` moved to the lowest free number >= ``at_least``, close-on-exec; the original is
    closed. Raises ``OSError`` (the original then stays)."""
    import fcntl

    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, at_least)
    os.close(fd)
    return int(new)


def let_go(sock: socket.socket | None, mine: Ident | None) -> None:
    """Close ``sock`` if its descriptor is still ours; else forget it, closing nothing."""
    if sock is None:
        return
    try:
        if still_ours(sock, mine):
            sock.close()
        else:
            sock.detach()
    except OSError:
        pass
