"""Durable files on disk: atomic writes, staged folders, and the package versions a result records.

The bottom floor with ``errors``: it imports nothing from winnow. Every file winnow
writes for a later reader (a manifest, a shard, a curation table, a plot, an exported
model folder) goes through here, so "a crash leaves the old file or the new one, never
half of one" is implemented once:

* the new content is written to a temporary sibling in the same folder (same file
  system, so the rename is atomic);
* the temporary file is flushed and ``fsync``-ed before the rename, so the rename
  never exposes a file whose blocks are not yet on disk;
* after ``os.replace`` the folder itself is ``fsync``-ed, so the new directory entry
  survives a power cut (POSIX only guarantees the rename is durable once the folder
  is synced).

Cost: one extra ``fsync`` of the file and one of its folder per write. The largest
writes that go through here are checkpoints' JSON metadata and evaluation shards
(kilobytes to a few MB); model weights are written by the checkpoint manager and the
HF exporter into a staged folder (``staged_directory``), which syncs each file once.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "cache_root",
    "fsync_directory",
    "git_commit",
    "package_versions",
    "publish_directory",
    "rename_in_staging",
    "replace_durably",
    "resolve_cache_dir",
    "staged_directory",
]


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename or a new entry in ``directory`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (and Windows) refuse fsync on a folder; the rename itself stands
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """``os.replace(source, target)`` followed by an fsync of the target's folder."""
    os.replace(source, target)
    fsync_directory(Path(target).parent)


def _default_file_mode() -> int:
    # mkstemp creates 0600 files; a published file gets the mode open() would have given it.
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _default_file_mode()


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` to produce the new file, then sync and rename it over ``path``.

    ``write`` receives a path in the same folder (so writers that want a file name, such as
    ``pyarrow.parquet.write_table`` or ``Figure.savefig``, work unchanged). If it raises,
    the temporary file is removed and ``path`` keeps its old content.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, _FILE_MODE)
        _fsync_file(tmp)
        replace_durably(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], payload: Any, *, indent: int | None = 1,
                      sort_keys: bool = False) -> Path:
    """JSON with a trailing newline (``json.dumps`` settings as given)."""
    return atomic_write_text(path, json.dumps(payload, indent=indent, sort_keys=sort_keys) + "\n")


def publish_directory(staging: str | os.PathLike[str], target: str | os.PathLike[str], *,
                      overwrite: bool) -> None:
    """Rename the finished folder ``staging`` to ``target`` after syncing every file in it.

    With ``overwrite`` an existing ``target`` is moved aside first and deleted only after
    the new folder is in place, so a crash at any point leaves a complete folder under the
    target's name or its complete predecessor beside it. Without it an existing
    ``target`` raises ``FileExistsError`` and ``staging`` is left for the caller.
    """
    staging, target = Path(staging), Path(target)
    for file in sorted(p for p in staging.rglob("*") if p.is_file()):
        _fsync_file(file)
    try:
        os.rename(staging, target)  # fails on an existing non-empty folder
    except OSError:
        if not target.exists():
            raise
        if not overwrite:
            raise FileExistsError(f"{target} exists") from None
        # Two renames: the old folder stays complete until the new one is in place.
        retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, retired / target.name)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(retired / target.name, target)
            raise
        finally:
            shutil.rmtree(retired, ignore_errors=True)
    fsync_directory(target.parent)


@contextmanager
def staged_directory(target: str | os.PathLike[str], *, overwrite: bool = True) -> Iterator[Path]:
    """Yield an empty sibling folder to fill; on success it becomes ``target`` (``publish_directory``).

    On an exception inside the block, or a refused publish, the staged folder is deleted
    and ``target`` is untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        publish_directory(staging, target, overwrite=overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def rename_in_staging(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Rename a file inside a folder that no reader sees yet (a ``staged_directory``).

    No durability is needed here: ``publish_directory`` syncs the folder's files before
    the folder itself appears under its final name.
    """
    os.rename(source, target)


# What a stage's manifest records: the packages whose versions can change its numbers.
RESULT_PACKAGES = ("winnow", "torch", "transformers", "megatron-core", "math-verify", "numpy", "pyarrow")


def package_versions(names: Iterable[str] = RESULT_PACKAGES) -> dict[str, str]:
    """``{"python": ..., name: version or "not installed"}``, for a result's manifest."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_commit(folder: str | os.PathLike[str] | None = None) -> str:
    """The commit of the git checkout holding ``folder`` (default: winnow's own source), with ``+dirty`` when
    tracked files differ from it; ``"unknown"`` outside a checkout or without git."""
    import subprocess

    where = Path(folder) if folder is not None else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if changed else "")


# ---------------------------------------------------------------- the cache root

CACHE_ENV = "WINNOW_CACHE"


def cache_root() -> Path:
    """The one folder every winnow cache lives under, absolute.

    ``$WINNOW_CACHE`` if set; else ``$XDG_CACHE_HOME/winnow``; else ``~/.cache/winnow``. It
    never depends on the current folder, so `winnow rl` started anywhere finds the base
    policy a `winnow bootstrap` cached elsewhere instead of silently training it again.
    """
    explicit = os.environ.get(CACHE_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    # The XDG spec ignores a relative XDG_CACHE_HOME; so does this.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "winnow"


def resolve_cache_dir(path: str | os.PathLike[str]) -> Path:
    """A cache folder option: an absolute path (after ``~``) is used as given, a relative one lives under ``cache_root()``."""
    folder = Path(path).expanduser()
    return folder if folder.is_absolute() else cache_root() / folder
