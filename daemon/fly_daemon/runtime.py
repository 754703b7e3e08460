"""Where a daemon lives on disk (socket, pidfile, log) and the lock that keeps it one per endpoint.

The pidfile is also a lock (`fcntl.flock`): the daemon holding it serves the endpoint. A crash
releases the lock with the process, so a stale pidfile or ipc socket is recognised and replaced.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import re
from pathlib import Path

from fly_llm.common.endpoints import runtime_dir


class AlreadyRunning(RuntimeError):
    """Another daemon already serves this endpoint."""


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint, None for other transports."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def tcp_host(endpoint: str) -> str | None:
    """The host part of a tcp:// endpoint ('*' binds every interface), None for other transports."""
    match = re.fullmatch(r"tcp://(\[?[^\]]*\]?):(\d+|\*)", endpoint)
    return match.group(1).strip("[]") if match else None


def check_endpoint(endpoint: str) -> None:
    """Raise ValueError unless `endpoint` is an ipc:// path or a tcp://host:port address."""
    if ipc_path(endpoint) is None and tcp_host(endpoint) is None:
        raise ValueError(f"unsupported endpoint {endpoint!r}: use ipc:///path/to.sock or tcp://127.0.0.1:PORT")


def is_loopback(endpoint: str) -> bool:
    """True for ipc endpoints and tcp endpoints bound to a loopback address."""
    host = tcp_host(endpoint)
    return host is None or is_loopback_host(host)


def is_loopback_host(host: str) -> bool:
    """True for 'localhost' and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(address: str) -> tuple[str, int]:
    """(host, port) of 'HOST:PORT' or '[IPV6]:PORT' (the HTTP front's address); ValueError if malformed."""
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})", address)
    if match is None or int(match.group(2)) > 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:8000), got {address!r}")
    return match.group(1).strip("[]"), int(match.group(2))


def open_private(path: Path, flags: int) -> int:
    """Open a daemon's own file (created 0600) for writing; OSError if `path` is a symbolic link.

    The pidfile and log may live next to an ipc socket in a shared directory, where a link planted
    in their place would make the daemon write (or truncate) whatever file it points to.
    """
    try:
        return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(f"refusing to open {path}: it is a symbolic link") from None
        raise


def daemon_files(endpoint: str) -> tuple[Path, Path]:
    """(pidfile, logfile) of the daemon serving `endpoint`."""
    sock = ipc_path(endpoint)
    if sock is not None:
        return Path(f"{sock}.pid"), Path(f"{sock}.log")
    stem = re.sub(r"[^A-Za-z0-9.]+", "-", endpoint.removeprefix("tcp://"))
    base = runtime_dir() / f"tcp-{stem}"
    return Path(f"{base}.pid"), Path(f"{base}.log")


class PidLock:
    """The pidfile of one endpoint, locked for the daemon's lifetime."""

    def __init__(self, endpoint: str) -> None:
        self.path = daemon_files(endpoint)[0]
        self._fd: int | None = None

    def acquire(self) -> None:
        """Lock the pidfile and write our pid; raise AlreadyRunning if a live daemon holds it.

        The lock counts only if the path still names the file we locked: a daemon that stops removes
        its pidfile while holding the lock, so a file locked after that is an orphan and we start over.
        """
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        while True:
            fd = open_private(self.path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                pid = read_pid(self.path)
                raise AlreadyRunning(f"a fly-daemon (pid {pid}) is already running; pidfile {self.path}") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Remove the pidfile while still holding its lock, then drop the lock."""
        if self._fd is not None:
            if _same_file(self._fd, self.path):
                self.path.unlink()
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    """True if `path` names the file open as `fd` (same device and inode)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (info.st_dev, info.st_ino) == (mine.st_dev, mine.st_ino)


def read_pid(path: Path) -> int | None:
    """The pid written in a pidfile, None if unreadable."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def running_pid(endpoint: str) -> int | None:
    """The pid of the live daemon holding the endpoint's lock, None if there is none (or it is stale)."""
    path = daemon_files(endpoint)[0]
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_pid(path)
    finally:
        os.close(fd)
    return None
