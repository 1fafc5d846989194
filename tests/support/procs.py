"""Processes as the tests look at them, from /proc."""

from __future__ import annotations

from pathlib import Path


def live_children(pid: int) -> list[tuple[int, bytes]]:
    """(pid, NUL-separated command line) of the live (not zombie) children of `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append((int(stat.parent.name), cmdline))
    return out


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out
