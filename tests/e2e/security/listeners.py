"""Every listening TCP socket of a process tree, read from /proc (Linux).

    process_tree(root_pid)   the root and all its descendants (by /proc/<pid>/stat ppid)
    listeners(pids)          one Listener per (pid, listening socket), with its bound address

A socket belongs to a process when /proc/<pid>/fd holds a link `socket:[inode]` whose inode
is a LISTEN row (state 0A) of /proc/<pid>/net/tcp or tcp6.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    comm: str  # the process's name (/proc/<pid>/comm)
    host: str  # the bound address: "127.0.0.1", "0.0.0.0", "::"
    port: int


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The name (field 2) may hold spaces and parentheses: split after its last ')'.
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_tree(root_pid: int) -> list[int]:
    """root_pid and every live descendant, parents before children."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _ppid(int(entry))
            if ppid is not None:
                parent_of[int(entry)] = ppid
    tree, frontier = [root_pid], [root_pid]
    while frontier:
        children = sorted(p for p, pp in parent_of.items() if pp in frontier)
        tree += children
        frontier = children
    return tree


def _decode_address(hex_addr: str) -> tuple[str, int]:
    host_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(host_hex)
    if len(raw) == 4:
        host = str(ipaddress.IPv4Address(raw[::-1]))
    else:  # tcp6: four little-endian 32-bit words
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        addr = ipaddress.IPv6Address(words)
        host = str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)
    return host, int(port_hex, 16)


def _listening_inodes(pid: int) -> dict[int, tuple[str, int]]:
    found = {}
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == _LISTEN:
                found[int(fields[9])] = _decode_address(fields[1])
    return found


def listeners(pids: list[int]) -> list[Listener]:
    """Every listening socket each pid holds open."""
    out = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone meanwhile
        table = _listening_inodes(pid)
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[len("socket:[") : -1])
                if inode in table:
                    host, port = table[inode]
                    out.append(Listener(pid, comm, host, port))
    return sorted(set(out), key=lambda x: (x.pid, x.port))
