"""Measure one-way TCP throughput between two hosts: `serve PORT NBYTES` / `send HOST PORT NBYTES`.

Used by the namespace tests to check that the links exist and that tbf shaping
really slows one of them. Prints `bytes_per_s=<float>` on the receiving side.
"""

from __future__ import annotations

import socket
import sys
import time


def serve(port: int, nbytes: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as srv:
        srv.settimeout(20)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(20)
            got = 0
            t0 = 0.0
            while got < nbytes:
                b = conn.recv(1 << 20)
                if not b:
                    break
                if got == 0:
                    t0 = time.perf_counter()
                got += len(b)
            dur_s = time.perf_counter() - t0
            conn.sendall(b"k")
    print(f"bytes_per_s={got / dur_s:.1f} nbytes={got}", flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            s = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with s:
        s.settimeout(20)
        s.sendall(b"x" * nbytes)
        s.recv(1)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
