"""A process's CPU time, memory and open descriptors, read from /proc (Linux only, no psutil)."""

from __future__ import annotations

import os
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time (s) the process has used so far (fields 14 and 15 of /proc/PID/stat)."""
    # The command name in field 2 is in parentheses and may hold spaces: split after the last ")".
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def rss_bytes(pid: int) -> int:
    """Resident set size (bytes), VmRSS of /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ProcessLookupError(pid)


def open_fds(pid: int) -> int:
    """Open file descriptors (sockets, pipes, files) of the process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def children(pid: int) -> list[int]:
    """Direct children of `pid` (e.g. nginx's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


_TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
               "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN",
               "0B": "CLOSING"}


def describe_fds(pid: int) -> dict[str, int]:
    """Open descriptors by kind; TCP sockets as "tcp <state> local:<port>|remote:<port>", to tell a leak
    of connections to Triton from a pool of clients' keep-alive connections."""
    inodes: dict[str, tuple[str, str, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            inodes[fields[9]] = (_TCP_STATES.get(fields[3], fields[3]), str(local_port), str(remote_port))
    kinds: dict[str, int] = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inode = target[8:-1]
            state, local, remote = inodes.get(inode, ("unix-or-other", "", ""))
            kind = f"tcp {state} local:{local} remote:{remote}" if local else "socket (unix/other)"
        elif target.startswith(("pipe:", "anon_inode:")):
            kind = target.split("[")[0].split(":")[0] + ":" + target.split(":")[1].split("[")[0]
        else:
            kind = "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds
