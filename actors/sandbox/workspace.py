"""A session's workspace on the host: path-safe file operations that never follow a symbolic link.

- Owns: `Workspace`, one directory under the supervisor's scratch root, and what the file tools do in it
  (list, read, write, exact search-and-replace, changed files, digest, a fresh copy for grading, removal).
- Guarantee: no path leaves the workspace, a symbolic link is refused, never followed, and writes respect
  a per-file and a whole-workspace size limit.
- Does not: run commands (actors/sandbox/jailrun.py), parse tool arguments (actors/sandbox/tools.py).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Final

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_DEPTH: Final = 64
"""Deepest directory nesting walked (list, snapshot, copy)."""
MAX_INODES: Final = 65536
"""Files and directories a workspace's tmpfs holds (each costs memory even when empty)."""
_MS_NOSUID: Final = 2
_MS_NODEV: Final = 4
_MNT_DETACH: Final = 2
_LIBC: list[ctypes.CDLL] = []


def _libc() -> ctypes.CDLL:
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def mount_tmpfs(path: Path, size_bytes: int, uid: int) -> bool:
    """Mount a tmpfs of `size_bytes` (and MAX_INODES inodes) owned by `uid` on `path`; False when this
    process may not mount (no root, or a container without the right)."""
    opts = f"size={max(size_bytes, 1 << 16)},nr_inodes={MAX_INODES},mode=0755,uid={uid},gid={uid}".encode()
    ok = _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) == 0
    return ok


def unmount(path: Path) -> None:
    """Detach the tmpfs on `path` (lazily: a process still inside cannot keep it)."""
    _libc().umount2(str(path).encode(), _MNT_DETACH)


class WorkspaceError(Exception):
    """A file operation was refused or failed; the text says why, for the model to read."""


def parts_of(path: str) -> list[str]:
    """The components of a workspace-relative path ("." and "" are the workspace itself).

    :raises WorkspaceError: absolute, `..`, NUL, or not a string.
    """
    if not isinstance(path, str):
        raise WorkspaceError(f"path must be a string, got {type(path).__name__}")
    if "\0" in path:
        raise WorkspaceError(f"path {path!r} contains a NUL byte")
    if path.startswith("/"):
        raise WorkspaceError(f"path {path!r} is absolute; paths are relative to the workspace")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise WorkspaceError(f"path {path!r} leaves the workspace ('..' is not allowed)")
    return parts


class Workspace:
    """One session's directory. Size limits in bytes; `uid` owns what is written (None: this process).

    Every path is relative to the workspace; `..`, absolute paths and NUL bytes are refused, and every
    component is opened relative to its parent's directory fd with O_NOFOLLOW, so a symbolic link (one a
    `run` planted, pointing outside or at another session) is refused, never followed. Only regular files
    are read or written (a FIFO or socket a command made is refused without blocking), and a file with other
    hard links is not overwritten. Writes respect a per-file and a whole-workspace size limit. When the
    supervisor is root the workspace is a tmpfs of its own (`quota_bytes`, `MAX_INODES` files), so what a
    command writes is bounded too (it gets ENOSPC), and files and directories are owned by the sandbox uid;
    without root a command's writes are bounded only by its file-size rlimit and its timeout.
    """

    def __init__(self, root: Path, *, max_file_bytes: int, max_total_bytes: int, uid: int | None,
                 quota_bytes: int | None = None) -> None:
        self.root = root
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.uid = uid
        self.quota_bytes = quota_bytes
        self.base: dict[str, str] = {}
        """sha256 hex of every seeded file: `changed()` compares against it."""
        root.mkdir(mode=0o755)
        self._own(str(root))
        self.mounted = quota_bytes is not None and uid is not None and mount_tmpfs(root, quota_bytes, uid)

    def _own(self, path: str, dir_fd: int | None = None) -> None:
        if self.uid is not None:
            os.chown(path, self.uid, self.uid, dir_fd=dir_fd, follow_symlinks=False)

    # ---- walking ------------------------------------------------------------------------------------
    def _open_dir(self, parts: list[str], *, create: bool = False) -> int:
        """A directory fd for `parts` below the root, every component opened with O_NOFOLLOW."""
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for i, name in enumerate(parts):
                try:
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise WorkspaceError(f"{'/'.join(parts[:i + 1])}: no such directory") from None
                    os.mkdir(name, 0o755, dir_fd=fd)
                    self._own(name, fd)
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as err:
                    raise self._why(err, parts[:i + 1], fd, name) from None
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _why(err: OSError, parts: list[str], dir_fd: int, name: str) -> WorkspaceError:
        where = "/".join(parts)
        try:
            mode = os.lstat(name, dir_fd=dir_fd).st_mode
            if stat.S_ISLNK(mode):
                return WorkspaceError(f"{where} is a symbolic link; links are not followed")
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return WorkspaceError(f"{where} is not a regular file or directory")
        except OSError:
            pass
        if err.errno == errno.ENOTDIR:
            return WorkspaceError(f"{where} is not a directory")
        return WorkspaceError(f"{where}: {os.strerror(err.errno or 0)}")

    def _open_file(self, path: str, flags: int, *, create_dirs: bool = False) -> tuple[int, int, str]:
        """(parent dir fd, file fd, name): the caller closes both. Only regular files."""
        parts = parts_of(path)
        if not parts:
            raise WorkspaceError(f"path {path!r} is the workspace itself, not a file")
        parent = self._open_dir(parts[:-1], create=create_dirs)
        name = parts[-1]
        try:
            fd = os.open(name, flags, 0o644, dir_fd=parent)
        except FileNotFoundError:
            os.close(parent)
            raise WorkspaceError(f"{path}: no such file") from None
        except OSError as err:
            why = self._why(err, parts, parent, name)
            os.close(parent)
            raise why from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            os.close(parent)
            raise WorkspaceError(f"{path} is not a regular file")
        return parent, fd, name

    def entries(self, path: str = ".") -> Iterator[tuple[str, str, int]]:
        """(relative path, kind, size) of everything below `path`, parents first, sorted; kind is file,
        dir, link or other. Links are reported, never entered."""
        parts = parts_of(path)
        fd = self._open_dir(parts)
        try:
            yield from self._walk(fd, "/".join(parts), 0)
        finally:
            os.close(fd)

    def _walk(self, fd: int, prefix: str, depth: int) -> Iterator[tuple[str, str, int]]:
        with os.scandir(fd) as it:
            listed = sorted(it, key=lambda e: e.name)
        for entry in listed:
            rel = f"{prefix}/{entry.name}" if prefix else entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                yield rel, "link", 0
            elif stat.S_ISDIR(st.st_mode):
                yield rel, "dir", 0
                if depth < MAX_DEPTH:
                    try:
                        sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                    except OSError:
                        continue
                    try:
                        yield from self._walk(sub, rel, depth + 1)
                    finally:
                        os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                yield rel, "file", st.st_size
            else:
                yield rel, "other", 0

    def total_bytes(self) -> int:
        return sum(size for _, kind, size in self.entries() if kind == "file")

    # ---- file tools ---------------------------------------------------------------------------------
    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """At most `limit` bytes (default: the file-size limit) of a regular file."""
        parent, fd, _ = self._open_file(path, _READ_FLAGS)
        try:
            cap = self.max_file_bytes if limit is None else limit
            chunks: list[bytes] = []
            got = 0
            while got < cap and (chunk := os.read(fd, min(1 << 20, cap - got))):
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
            os.close(parent)

    def size_of(self, path: str) -> int:
        parent, fd, _ = self._open_file(path, _READ_FLAGS)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)
            os.close(parent)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Create or replace a regular file (parent directories made as needed), within the limits.

        :raises WorkspaceError: too large, the workspace would be too large, a link, or not a regular file.
        """
        if len(data) > self.max_file_bytes:
            raise WorkspaceError(f"{path}: {len(data)} bytes is past the file-size limit of "
                                 f"{self.max_file_bytes} bytes; nothing was written")
        old = 0
        try:
            old = self.size_of(path)
        except WorkspaceError:
            pass
        total = self.total_bytes() - old + len(data)
        if total > self.max_total_bytes:
            raise WorkspaceError(f"{path}: writing {len(data)} bytes would make the workspace {total} bytes, past "
                                 f"its limit of {self.max_total_bytes} bytes; nothing was written")
        parent, fd, name = self._open_file(path, _WRITE_FLAGS, create_dirs=True)
        try:
            if os.fstat(fd).st_nlink > 1:
                raise WorkspaceError(f"{path} has other hard links; it is not overwritten")
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            self._own(name, parent)
        finally:
            os.close(fd)
            os.close(parent)

    def seed(self, files: dict[str, bytes]) -> None:
        """Write the opening files and remember their digests as the base of `changed()`."""
        total = sum(len(v) for v in files.values())
        if total > self.max_total_bytes:
            raise WorkspaceError(f"the files to open with are {total} bytes, past the workspace limit of "
                                 f"{self.max_total_bytes} bytes")
        for path, data in sorted(files.items()):
            self.write_bytes(path, data)
            self.base["/".join(parts_of(path))] = hashlib.sha256(data).hexdigest()

    def changed(self) -> tuple[dict[str, bytes], dict[str, str], list[str], list[str]]:
        """(changed or new files → content, their sha256 hex, deleted seeded paths, skipped entries) since
        `seed`: links and special files are skipped (named in the last list), never read."""
        files: dict[str, bytes] = {}
        digests: dict[str, str] = {}
        seen: set[str] = set()
        skipped: list[str] = []
        for rel, kind, _ in self.entries():
            if kind in ("link", "other"):
                skipped.append(rel)
            if kind != "file":
                continue
            seen.add(rel)
            data = self.read_bytes(rel, self.max_total_bytes)
            digest = hashlib.sha256(data).hexdigest()
            if self.base.get(rel) != digest:
                files[rel], digests[rel] = data, digest
        deleted = sorted(p for p in self.base if p not in seen)
        return files, digests, deleted, skipped

    def tree_digest(self) -> str:
        """`sha256:<hex>` of every regular file's path and content, in path order: what a snapshot captures (links,
        special files and empty directories are not part of it), so a workspace restored from a snapshot has the
        digest the snapshotted one had."""
        tree = hashlib.sha256()
        for rel, kind, _ in self.entries():
            if kind == "file":
                content = hashlib.sha256(self.read_bytes(rel, self.max_total_bytes)).hexdigest()
                tree.update(f"{len(rel)}:{rel}:{content}\n".encode())
        return f"sha256:{tree.hexdigest()}"

    def copy_to(self, dest: Path, *, extra_bytes: int = 0, without_bytecode: bool = False) -> Workspace:
        """A fresh copy of this workspace's directories, files and links (as links) at `dest` (new), with room
        for `extra_bytes` more. `without_bytecode` leaves out `__pycache__` directories and `.pyc` files, so
        nothing run in the copy can load bytecode older than its source (a same-size edit in the same second as
        the compile, or an unchecked-hash .pyc, would otherwise run the old code)."""
        copy = Workspace(dest, max_file_bytes=self.max_file_bytes, max_total_bytes=self.max_total_bytes + extra_bytes,
                         uid=self.uid, quota_bytes=None if self.quota_bytes is None else self.quota_bytes + extra_bytes)
        for rel, kind, _ in self.entries():
            if without_bytecode and (rel.endswith(".pyc") or "__pycache__" in rel.split("/")):
                continue
            target = dest / rel
            if kind == "dir":
                target.mkdir(mode=0o755)
                self._own(str(target))
            elif kind == "file":
                target.write_bytes(self.read_bytes(rel, self.max_total_bytes))
                self._own(str(target))
            elif kind == "link":
                parts = rel.split("/")
                parent = self._open_dir(parts[:-1])
                try:
                    os.symlink(os.readlink(parts[-1], dir_fd=parent), target)
                finally:
                    os.close(parent)
                self._own(str(target))
        return copy

    def remove(self) -> None:
        """Remove the workspace: its tmpfs detached, the directory removed (shutil.rmtree works by fd here
        and does not follow links)."""
        if self.mounted:
            unmount(self.root)
            self.mounted = False
        shutil.rmtree(self.root, ignore_errors=True)


__all__ = ["MAX_DEPTH", "MAX_INODES", "Workspace", "WorkspaceError", "mount_tmpfs", "parts_of", "unmount"]
