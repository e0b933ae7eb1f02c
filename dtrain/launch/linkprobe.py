"""How fast is a link between two nodes of a ``dtrain cluster``? Run inside each node's namespace by ``up``::

    ip netns exec NODE1 python -m dtrain.launch.linkprobe serve ADDRESS PORT NBYTES
    ip netns exec NODE2 python -m dtrain.launch.linkprobe call ADDRESS PORT NBYTES    # prints: LATENCY_US BITS_S

The caller sends one byte and waits for it to come back, 200 times (half a round trip: the one-way latency of a
small message, TCP's and the kernel's included, as an MPI message of a few bytes sees it), then streams NBYTES and
waits for the server's one-byte answer that all of it arrived (the rate a stream reaches through the shaping).
"""

from __future__ import annotations

import socket
import sys
import time

ROUND_TRIPS = 200
TIMEOUT_S = 30


def serve(address: str, port: int, nbytes: int) -> None:
    with socket.create_server((address, port)) as server:
        server.settimeout(TIMEOUT_S)
        peer, _ = server.accept()
    with peer:
        peer.settimeout(TIMEOUT_S)
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(ROUND_TRIPS):
            peer.sendall(peer.recv(1))
        received = 0
        while received < nbytes:
            chunk = peer.recv(1 << 20)
            if not chunk:
                raise ConnectionError(f"the caller stopped after {received} of {nbytes} bytes")
            received += len(chunk)
        peer.sendall(b"k")


def call(address: str, port: int, nbytes: int) -> tuple[float, float]:
    """(one-way latency in microseconds, a stream's rate in bits/s)."""
    deadline = time.monotonic() + 5
    while True:  # (the server may not listen yet)
        try:
            peer = socket.create_connection((address, port), timeout=TIMEOUT_S)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with peer:
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        for _ in range(ROUND_TRIPS):
            peer.sendall(b"x")
            peer.recv(1)
        one_way = (time.perf_counter() - start) / (2 * ROUND_TRIPS)
        start = time.perf_counter()
        peer.sendall(bytes(nbytes))
        peer.recv(1)
        seconds = time.perf_counter() - start - 2 * one_way  # (the answer's trip back is not the stream's)
    return one_way * 1e6, nbytes * 8 / seconds


def main(argv=None) -> int:
    role, address, port, nbytes = argv if argv is not None else sys.argv[1:]
    try:
        if role == "serve":
            serve(address, int(port), int(nbytes))
        else:
            latency_us, bits_s = call(address, int(port), int(nbytes))
            print(f"{latency_us:.1f} {bits_s:.0f}")
    except OSError as exc:  # (one line for up to pass on: the nodes cannot reach each other)
        print(f"{role}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
