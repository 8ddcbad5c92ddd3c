"""What the store daemon needs from the operating system: its socket, its arena's name, its
clients' credentials, file-descriptor limits.

One daemon per socket path. The daemon holds an exclusive ``flock`` on ``<socket>.lock`` for as
long as it runs; the lock file records the name of its DRAM arena in ``/dev/shm``. Arena names
are random (``kvtier-`` and 32 hex digits), never a process id: a restarted container reuses
pids, and daemons in other pid namespaces share ``/dev/shm``. A daemon that starts after one
that was killed finds the dead one's arena name in the lock file it now holds -- holding the
lock proves its owner is gone -- and removes that arena; it never touches an arena it cannot
prove dead. An existing file at the socket path that is not a socket is never removed.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import resource
import secrets
import select
import socket
import stat
import struct
from dataclasses import dataclass

from kvtier.tiers.arena import SHM_DIR

log = logging.getLogger(__name__)

ARENA_PREFIX = "kvtier-"
ARENA_NAME = re.compile(r"kvtier-[0-9a-f]{32}")
"""What a daemon's arena is called; a client maps nothing else."""


def new_arena_name() -> str:
    return ARENA_PREFIX + secrets.token_hex(16)


def default_socket_path() -> str:
    """``$KVTIER_SOCKET``, else ``$XDG_RUNTIME_DIR/kvtier.sock``, else
    ``/tmp/kvtier-<uid>/kvtier.sock`` (its directory made 0700)."""
    env = os.environ.get("KVTIER_SOCKET")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kvtier.sock")
    return os.path.join(f"/tmp/kvtier-{os.getuid()}", "kvtier.sock")


def check_socket_dir(path: str) -> None:
    """Refuse a default socket's directory that someone else could have made or can write:
    it must be a directory (not a link) owned by this user, with no access for anyone else.
    ValueError naming the problem."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        st = os.lstat(parent)
    except FileNotFoundError:
        return  # nothing there: a daemon makes it (0700) before it listens
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"the socket directory {parent} is not a directory (a link?): refusing it")
    if st.st_uid != os.geteuid():
        raise ValueError(f"the socket directory {parent} belongs to uid {st.st_uid}, not to this user "
                         f"({os.geteuid()}): another user may have made it to impersonate the daemon")
    if st.st_mode & 0o077:
        raise ValueError(f"the socket directory {parent} has mode {stat.S_IMODE(st.st_mode):o}: others "
                         "could replace the socket in it (it must be 0700)")


def ensure_socket_dir(path: str) -> None:
    """For the default socket path (:func:`default_socket_path`): make its private directory
    (0700) if it is missing, and refuse one that is not this user's own and private
    (ValueError): a directory another user made or can write lets them put a socket of their
    own there, and every engine would send its KV to it. An explicit path is the operator's
    choice (``[access] mode``/``group`` for sharing) and is not checked here."""
    if os.path.abspath(path) != os.path.abspath(default_socket_path()) or os.environ.get("KVTIER_SOCKET"):
        return
    parent = os.path.dirname(os.path.abspath(path))
    if parent.startswith("/tmp/kvtier-"):
        try:
            os.mkdir(parent, 0o700)
        except FileExistsError:
            pass
    check_socket_dir(path)


class SocketClaim:
    """The exclusive right to serve a socket path (``<socket>.lock``, flocked), and the record
    of the arena serving it."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.lock_path = self.socket_path + ".lock"
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ValueError(f"cannot open the lock file {self.lock_path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"another daemon is serving {self.socket_path}") from None
        self._fd = fd
        try:
            self._check_socket_path()
            self._remove_dead_arena()
        except BaseException:
            self.release()
            raise

    def _check_socket_path(self) -> None:
        try:
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ValueError(f"{self.socket_path} exists and is not a socket: refusing to replace it "
                             "(is --socket pointing at the wrong file?)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.socket_path)
        except OSError:
            os.unlink(self.socket_path)  # left by a daemon that died
            return
        finally:
            probe.close()
        raise ValueError(f"another daemon is serving {self.socket_path}")  # one without a lock file

    def recorded_arena(self) -> str | None:
        raw = os.pread(self._fd, 256, 0).decode(errors="replace").strip()
        return raw if ARENA_NAME.fullmatch(raw) else None

    def _remove_dead_arena(self) -> None:
        name = self.recorded_arena()
        if name is None:
            return
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
            log.info("removed the arena of a daemon that died: %s", path)

    def record_arena(self, name: str | None) -> None:
        os.ftruncate(self._fd, 0)
        if name:
            os.pwrite(self._fd, (name + "\n").encode(), 0)
        os.fsync(self._fd)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is at the other end of a Unix socket (``SO_PEERCRED``; pid 0 when not visible from
    this pid namespace)."""

    pid: int
    uid: int
    gid: int


_UCRED = struct.Struct("3i")


def peer_of(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return Peer(*_UCRED.unpack(raw))


class ProcessWatch:
    """Whether a client process has exited, by a pidfd opened when it connected (immune to
    pid reuse); None where there is none (pid not visible, no pidfd support)."""

    def __init__(self, pid: int) -> None:
        self._fd: int | None = None
        if pid > 0 and hasattr(os, "pidfd_open"):
            try:
                self._fd = os.pidfd_open(pid)
            except OSError:
                self._fd = None

    @property
    def known(self) -> bool:
        return self._fd is not None

    def exited(self) -> bool:
        if self._fd is None:
            return False
        poller = select.poll()  # select() refuses an fd >= 1024, which a busy daemon reaches
        poller.register(self._fd, select.POLLIN)
        return any(ev & select.POLLIN for _, ev in poller.poll(0))  # POLLNVAL (a bad fd) is not an exit

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def raise_fd_limit(want: int) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``want`` (up to the hard limit); the
    limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit to %d: %s", target, exc)
    return soft


def own_socket(path: str, mode: int, gid: int | None) -> None:
    os.chmod(path, mode)
    if gid is not None:
        try:
            os.chown(path, -1, gid)
        except OSError as exc:
            if exc.errno != errno.EPERM:
                raise
            raise ValueError(f"cannot give {path} to group {gid}: {exc.strerror}") from None
