"""Put rendered files on disk without ever exposing a half-written one.

A render is complete in memory before anything is written. Then:
- a new output directory is built beside its final place and renamed into it, so it
  appears whole or not at all;
- an existing one (maybe watched by a running Envoy, whose inotify watches follow the
  directory's inode, so the directory itself must stay) has each changed file written to a
  temp file beside it and fsynced first, all of them; only then is each renamed over its
  file (and the directory fsynced), in the order the target gives (`Target.write_rank`;
  Envoy: EDS before the clusters naming it, clusters before the routes naming them). A
  write that fails (disk full, a quota, a directory where a file goes) fails before any
  file is replaced, and its temp files are removed. Files of the previous render that are
  no longer produced are removed last, in the reverse order.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from ._diff import describe_change
from .errors import OutputError

MANIFEST = ".confgen-files"  # what the last render wrote, so stale files can be removed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stage(path: Path, data: bytes, mode: int) -> Path:
    """`data` in a temp file beside `path`, on disk (fsynced) with `mode`: ready to be renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        Path(tmp).chmod(mode)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` so readers see the old or the new content, never a mix."""
    tmp = _stage(path, data, mode)
    try:
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _check_relative(rel: str) -> None:
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts or not parts:
        raise OutputError(f"refusing to write outside the output directory: {rel!r}")


def _same_rank(path: str) -> int:
    return 0


def write_tree(
    files: Mapping[str, bytes], out_dir: Path, mode: int = 0o644, *, rank: Callable[[str], int] = _same_rank
) -> None:
    """Write `files` under `out_dir` (see the module docstring). On a live directory, files are
    replaced by ascending `rank(path)` (the target's order, e.g. `envoy.layout.write_rank`),
    then by path; files no longer produced are removed in the reverse order."""

    def order(path: str) -> tuple[int, str]:
        return rank(path), path

    for rel in files:
        _check_relative(rel)
    manifest = "".join(f"{rel}\n" for rel in sorted(files)).encode()
    try:
        if not out_dir.exists():
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
            try:
                for rel, data in files.items():
                    atomic_write(staging / rel, data, mode)
                atomic_write(staging / MANIFEST, manifest)
                staging.chmod(0o755)
                staging.rename(out_dir)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            _fsync_dir(out_dir.parent)
            return
        if not out_dir.is_dir():
            raise OutputError(f"{out_dir} exists and is not a directory")
        previous = _previous_files(out_dir)
        changed = [rel for rel in sorted(files, key=order)
                   if not (out_dir / rel).is_file() or (out_dir / rel).read_bytes() != files[rel]]
        staged: list[tuple[Path, Path]] = []
        try:
            for rel in changed:  # every new content on disk before any file is replaced
                if (out_dir / rel).is_dir():  # the rename would fail: fail now, before any
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(out_dir / rel))
                staged.append((_stage(out_dir / rel, files[rel], mode), out_dir / rel))
        except BaseException:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
                if tmp.parent != out_dir and not any(tmp.parent.iterdir()):
                    tmp.parent.rmdir()  # made for a file of this render (a new pool's EDS)
            raise
        for i, (tmp, target) in enumerate(staged):
            try:
                tmp.replace(target)
            except BaseException:
                for left, _ in staged[i:]:
                    left.unlink(missing_ok=True)
                raise
            _fsync_dir(target.parent)
        for rel in sorted(previous - set(files), key=order, reverse=True):
            stale = out_dir / rel
            stale.unlink(missing_ok=True)
            if stale.parent != out_dir and not any(stale.parent.iterdir()):
                stale.parent.rmdir()
        # Any rename in this directory wakes Envoy's LDS/CDS watches: skip a no-op manifest.
        if (out_dir / MANIFEST).exists() and (out_dir / MANIFEST).read_bytes() == manifest:
            return
        atomic_write(out_dir / MANIFEST, manifest)
    except OSError as exc:
        where = exc.filename if exc.filename else out_dir
        raise OutputError(f"cannot write {where}: {exc.strerror or exc}") from exc


def _previous_files(out_dir: Path) -> set[str]:
    try:
        lines = (out_dir / MANIFEST).read_text().splitlines()
    except FileNotFoundError:
        return set()
    out = set()
    for line in lines:
        try:
            _check_relative(line)
        except OutputError:
            continue
        out.add(line)
    return out


def diff_tree(files: Mapping[str, bytes], out_dir: Path, detail: bool = False) -> list[str]:
    """What differs between `files` and the directory: one line per file, [] when equal.

    With `detail`, each differing file is followed by indented lines saying what changed
    (per worker for endpoint files; see confgen._diff).
    """
    found = {
        str(p.relative_to(out_dir))
        for p in out_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    } if out_dir.is_dir() else set()
    lines = []
    for rel in sorted(set(files) | found):
        if rel not in found:
            lines.append(f"missing: {rel}")
        elif rel not in files:
            lines.append(f"extra:   {rel}")
        elif (on_disk := (out_dir / rel).read_bytes()) != files[rel]:
            lines.append(f"differs: {rel}")
            if detail:
                lines.extend(f"    {line}" for line in describe_change(rel, on_disk, files[rel]))
    return lines
