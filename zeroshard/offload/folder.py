"""The NVMe tier's folder: what is in it, who owns it, and what the disk under it can do.

Layout of a folder owned by a store:

    LOCK                  flock'ed by the live store (holds its pid); a crashed run's lock is free
    index.json            name -> file, dtype, shape, checksums (``zeroshard.offload.index``)
    <name>-<hash>.swp     one tensor's bytes, padded to ALIGN_BYTES

This module creates and probes the folder (writable? O_DIRECT? on a RAM filesystem?), takes and
frees its lock, names the swap files, reports free space, and deletes what a crashed run left.
The bytes themselves are read and written by ``zeroshard.offload.nvme``.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import itertools
import logging
import mmap
import os
import re
import threading
import time
from pathlib import Path

import xxhash

from .index import INDEX_NAME
from .tiers import OffloadError, OffloadSetupError

__all__ = [
    "ALIGN_BYTES",
    "LOCK_NAME",
    "MEMORY_FILESYSTEMS",
    "SUFFIX",
    "discard_folder",
    "file_name",
    "filesystem_type",
    "free_bytes",
    "holds_swap_files",
    "padded_bytes",
    "prepare_folder",
    "remove_if_empty",
    "swap_files",
    "take_lock",
    "unusable_because",
]

logger = logging.getLogger("zeroshard.offload")

# O_DIRECT needs offsets, lengths and memory aligned to the device's logical block (512 or 4096);
# 4096 satisfies both and is the page size, so mmap'ed and sliced buffers meet it.
ALIGN_BYTES = 4096
LOCK_NAME = "LOCK"
SUFFIX = ".swp"

# filesystems whose "files" are RAM: swapping to them moves nothing off the faster tier
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


def padded_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of ALIGN_BYTES (a swap file's size on disk)."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use on the folder's filesystem."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` ('ext4', 'xfs', 'tmpfs'...), '?' if unknown."""
    path = path.resolve()
    best_mount, best_type = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mount, fstype = line.split()[1:3]
                mount = mount.replace("\\040", " ")  # /proc/mounts escapes spaces
                inside = path == Path(mount) or Path(mount) in path.parents
                if inside and len(mount) >= len(best_mount):
                    best_mount, best_type = mount, fstype
    except OSError:
        pass
    return best_type


def file_name(name: str) -> str:
    """A readable, collision-free file name for a tensor name (which may hold '/' or '..')."""
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80].lstrip(".")
    return f"{readable}-{xxhash.xxh64_hexdigest(name.encode())[:12]}{SUFFIX}"


_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]*-[0-9a-f]{12}" + re.escape(SUFFIX))


def swap_files(folder: Path) -> list[Path]:
    """The files in `folder` named as ``file_name`` names them: the store's own. A user's file
    that merely ends in .swp (an editor's swap file) is not one, and is never deleted."""
    return [p for p in folder.glob("*" + SUFFIX) if _FILE_NAME.fullmatch(p.name)]


def unusable_because(error: OSError) -> str:
    """Why a folder could not be made or written, in words: the system's, except for a file
    standing where the folder (or a folder above it) should be, which it words as "File
    exists" or "Not a directory"."""
    if isinstance(error, (FileExistsError, NotADirectoryError)):
        link = Path(error.filename) if error.filename else None
        if link is not None and link.is_symlink() and not link.exists():
            return f"{link} is a symbolic link to {os.readlink(link)}, which does not exist"
        return "it, or a folder above it, is a file"
    return error.strerror or str(error)


def not_usable(folder: Path, error: OSError, what: str = "") -> OffloadSetupError:
    """The error for a swap folder that could not be made or written: the folder, why (after
    ``what``), and the fix (with the bytes free there when the disk is full)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{free_bytes(folder)} bytes are free there"
        except OSError:
            free = "its disk is full"
        fix = f"{free}; free disk space or pass folder= a directory on a bigger disk"
    else:
        fix = "pass folder= a writable directory on the disk that should hold the swap files"
    return OffloadSetupError(
        f"swap folder {folder} is not usable ({what}{unusable_because(error)}); {fix}"
    )


def prepare_folder(folder: Path, direct_io: bool | None) -> tuple[bool, bool]:
    """Create and test the folder now, so a bad one fails at construction, not mid-step.

    Returns (created, use_direct): whether the folder was made here, and whether O_DIRECT works.
    """
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}-{threading.get_ident()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.close(fd)
    except OSError as e:
        raise not_usable(folder, e) from e
    try:
        if direct_io is False:
            return created, False
        buf = mmap.mmap(-1, ALIGN_BYTES)  # page-aligned, as O_DIRECT wants
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            try:
                os.pwritev(fd, [buf], 0)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise not_usable(folder, e) from e  # (a full disk: the probe's one page)
            if direct_io:
                raise OffloadSetupError(
                    f"direct_io=True but {folder} does not support O_DIRECT ({e.strerror}); "
                    "use a folder on a real disk (not tmpfs) or direct_io=None"
                ) from e
            return created, False
        return created, True
    finally:
        probe.unlink(missing_ok=True)


class LockHeld(Exception):
    """A lock file another holder has (``pid``: the one it wrote, "?" when unreadable)."""

    def __init__(self, pid: str) -> None:
        super().__init__(pid)
        self.pid = pid


def pid_lock(path: Path, mode: int = 0o600) -> int:
    """flock ``path`` (created if missing) for this process, not waiting, and write our pid
    into it; the fd (closing it lets go; so does the kernel if the process dies). ``LockHeld``
    with the holder's pid when another open file holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            raise LockHeld(holder) from None
        if still_at(fd, path):
            break
        os.close(fd)  # its holder deleted it as we opened it: lock the file there now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # (a page: fails on a full disk)
    except OSError:
        os.close(fd)
        raise
    st = os.fstat(fd)
    _HELD[fd] = (st.st_dev, st.st_ino)
    return fd


def release_lock(fd: int) -> None:
    """Let go of a lock ``pid_lock`` took (close its fd)."""
    _HELD.pop(fd, None)
    os.close(fd)


_HELD: dict[int, tuple[int, int]] = {}
"""This process's lock fds (``pid_lock``) -> their files' (device, inode)."""


def _close_inherited_locks() -> None:
    """In a forked child (a DataLoader worker), its copies of the parent's lock fds are closed:
    an flock belongs to the open file, which fork shares, so a rank killed with its workers
    alive held its folders until they exited, and a restart there was refused as "in use by a
    live store". The parent's lock stays (its own fd still holds it)."""
    for fd, ident in list(_HELD.items()):
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == ident:
                os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


def still_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is still the one at ``path`` (not deleted or replaced)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _pid_in(fd: int) -> str:
    return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"


def take_lock(folder: Path) -> int:
    """Lock `folder` for this process (``pid_lock`` on its LOCK file); the lock's fd. The pid
    written into LOCK names the holder in the error another store gets. The folder is made
    again if it went as we took it: a finished store of this process empties and removes it
    from its finalizer, which may run late (a flaky FileNotFoundError on LOCK)."""
    for attempt in itertools.count(1):
        try:
            return pid_lock(folder / LOCK_NAME)
        except LockHeld as held:
            raise OffloadSetupError(
                _in_use(
                    folder,
                    held.pid,
                    "give each store, e.g. each rank or run, its own folder "
                    "(Offload(folder=...); --offload-folder on the command line)",
                )
            ) from None
        except FileNotFoundError:
            if attempt == _LOCK_TRIES:
                raise
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise not_usable(folder, e) from e


_LOCK_TRIES = 100


def collect_if_held_here(folder: Path) -> None:
    """Before a store takes ``folder``: when a store of this process holds its lock, run the
    cycle collector once. A store no longer used may wait for it (a model and its optimizer
    refer to each other: ``del model, opt`` leaves them to it), and its finalizer deletes its
    files, its lock and maybe the folder: so this runs before the folder is prepared, not while
    the new store takes the lock."""
    # A few tries: the store's I/O threads may still hold it for a moment after its last
    # request (a worker drops its task only when it takes the next), most visibly under load.
    if not _held_here(folder):
        return
    for _ in range(10):  # up to 1 s when a live store holds it: the error follows
        gc.collect()
        if not _held_here(folder):
            return
        time.sleep(0.1)


def _held_here(folder: Path) -> bool:
    """Whether a store of this process holds ``folder``'s lock."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: no store
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return _pid_in(fd) == str(os.getpid())
    finally:
        os.close(fd)


def _in_use(folder: Path, pid: str, fix: str) -> str:
    """The error for ``folder`` locked by the store of process ``pid``: another process's
    (``fix`` says what to do), or one of this process's own."""
    if pid == str(os.getpid()):
        return (
            f"{folder} is in use by a live store (pid {pid}, this process: another model or "
            "optimizer of it that is still referenced). Two models meant to live together (a "
            "teacher and a student) each need a folder of their own: Offload(folder=...) apart; "
            "one meant to be gone is still held by a name or by a tensor it computed (the last "
            "loss's graph holds the model: del loss, model, opt)"
        )
    if pid.isdigit() and not _alive(int(pid)):
        who = (
            f"pid {pid}, which has exited: a process it started holds the lock until it exits "
            "(one forked with a copy of it); stop that one or wait for it"
        )
    else:
        who = f"pid {pid}"
    return f"{folder} is in use by a live store ({who}); {fix}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # (another user's)
    return True


def clear_crashed(folder: Path) -> None:
    """Before a store takes ``folder``: a store of this process no longer used is collected, and
    the swap files a crashed run left there are discarded (with the folder, so that the new
    store makes it and removes it at its end); what they held comes back from checkpoints,
    never from them."""
    collect_if_held_here(folder)
    if holds_swap_files(folder) or (folder / LOCK_NAME).exists():  # (its lock alone: emptied)
        try:
            discard_folder(folder)  # refused while a live store holds it
        except OSError as e:  # (a folder gone read-only since that run: a bare OSError)
            raise not_usable(folder, e, "holds a crashed run's swap files, not discarded: ") from e
        logger.warning("discarded the swap files a crashed run left in %s", folder)


def holds_swap_files(folder: Path) -> bool:
    """Whether `folder` holds an index or swap files (an earlier run's store)."""
    return (folder / INDEX_NAME).exists() or bool(swap_files(folder))


def discard_folder(folder: Path) -> None:
    """Delete what a store left in `folder` (a crashed run), refusing if a live store holds it."""
    if not (folder / LOCK_NAME).exists() and not (folder / INDEX_NAME).exists():
        if holds_swap_files(folder):  # (whose is unknown: never deleted)
            raise OffloadSetupError(
                f"swap folder {folder} holds swap files but no {LOCK_NAME} or {INDEX_NAME}: "
                f"a run using it whose {LOCK_NAME} was deleted (a /tmp cleaner), or one that "
                "crashed before it wrote its index; delete the folder if no run uses it, or "
                "pass folder= another directory"
            )
        raise OffloadError(f"{folder} holds no store (no {LOCK_NAME} or {INDEX_NAME})")
    collect_if_held_here(folder)
    if not folder.is_dir() or not ((folder / LOCK_NAME).exists() or holds_swap_files(folder)):
        return  # the collected store took its files with it
    try:  # not created: another discard may just have deleted it, with the files
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        if not holds_swap_files(folder):
            return
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OffloadSetupError(
                _in_use(
                    folder,
                    _pid_in(fd),
                    "give each run its own folder (Offload(folder=...); "
                    "--offload-folder on the command line), or stop that one",
                )
            ) from None
        for path in swap_files(folder):
            path.unlink(missing_ok=True)
        for name in (INDEX_NAME, INDEX_NAME + ".tmp", LOCK_NAME):
            (folder / name).unlink(missing_ok=True)
    finally:
        os.close(fd)
    remove_if_empty(folder)


def remove_if_empty(folder: Path) -> None:
    """Remove `folder`; leave it, with a warning, when it holds files the store did not write."""
    try:
        folder.rmdir()
    except FileNotFoundError:
        pass  # removed meanwhile (another discard of it)
    except OSError:
        logger.warning("left %s in place: it holds files the store did not write", folder)
