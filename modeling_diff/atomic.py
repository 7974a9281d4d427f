"""Directories written all at once: into a temporary sibling, renamed into place only when complete, so a
reader never sees a half-written checkpoint, export or result (and a failure leaves the old one untouched)."""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(dst: str | os.PathLike, overwrite: bool = False, protect: tuple = (), name: str = "destination"):
    """Yield an empty temporary directory next to `dst`; when the block succeeds it replaces `dst` (renames), when
    it fails it is removed. An existing non-empty `dst` is replaced only with `overwrite=True`; `dst` may not be,
    contain or lie inside any path of `protect` (a source that is only read). `name` names `dst` in errors."""
    dst = Path(dst).resolve()
    for path in map(lambda p: Path(p).resolve(), protect):
        if dst == path or path in dst.parents or dst in path.parents:
            raise ValueError(f"{name} {str(dst)!r} must not be, contain or lie inside the source {str(path)!r}")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{name} {str(dst)!r} exists and is not a directory")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"{name} {str(dst)!r} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.chmod(0o755)  # mkdtemp makes it private to the user
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old.", dir=dst.parent))
        dst.rename(old / dst.name)
        staging.rename(dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(dst)


__all__ = ["atomic_directory"]
