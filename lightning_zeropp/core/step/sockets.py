"""Waking ranks blocked on this one: shut down this process's gloo TCP connections.

torch 2.13's gloo `ProcessGroup.abort()` is a no-op, and a gloo connection ends only when its
process destroys the backend or exits. A failing rank shuts its connections down instead; the
peers see them close and fail their pending operations at once instead of at the timeout.
"""

from __future__ import annotations

import os
import socket
import stat

import torch.distributed as dist

__all__ = ["cut_gloo_connections", "tcp_port"]


def tcp_port(store: dist.Store) -> int | None:
    """The TCPStore port behind `store`: its connections must survive the cut."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.port if isinstance(store, dist.TCPStore) else None


def cut_gloo_connections(keep_port: int | None) -> int:
    """Shut down this process's gloo TCP connections (the peers see them close); return how many.

    Gloo gives its pair sockets a receive timeout (SO_RCVTIMEO), which a logger's or an HTTP
    client's lack: those survive. shutdown(), not close(): gloo keeps its descriptor, sees the
    connection end and fails its own pending operations.
    """
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    cut = 0
    for name in os.listdir(fd_dir):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            dup = os.dup(fd)  # shares the connection; ours to close
        except (OSError, ValueError):
            continue  # closed meanwhile, or not a descriptor
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ports = (sock.getsockname()[1], sock.getpeername()[1])
                timeout = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
                if sock.type == socket.SOCK_STREAM and keep_port not in ports and any(timeout):
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
            except OSError:
                continue  # a listener (no peer), or already closed
    return cut
