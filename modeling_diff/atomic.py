"""Directories written all at once: into a temporary sibling, renamed into place only when complete, so a
reader never sees a half-written checkpoint, export or result (and a failure leaves the old one untouched).

What `atomic_directory` guarantees, and how:
- nothing is replaced without `overwrite`: the final rename itself refuses a destination that became non-empty
  while the work ran (rename(2) does not replace a non-empty directory), not only a check at the start;
- one writer per destination: a lock file `.<name>.lock` next to it, held (`flock`) from the checks to the
  rename, so a second writer is refused at once instead of racing the first;
- no leftovers: staging directories are named `.<name>.<pid>.<random>.tmp` (`.old` for the output being
  replaced); a failure, Ctrl-C or SIGTERM removes its own, and the next writer to the same destination removes
  those a killed writer left (SIGKILL, the OOM killer, a power cut), putting back first an output that a writer
  killed between its two renames had moved aside. Every writer holds the lock for as long as any of its staging
  directories exists, so those that the lock's holder finds are a dead writer's whatever the pid in their name
  (which tells nothing: a container's writer is PID 1 on every run); a live writer's are never touched, since it
  holds the lock;
- any name the filesystem allows: where `<name>` plus what a staging name adds would be longer than that (231 bytes
  or more, of 255), the lock file and staging directories are named after the start of `<name>` and a hash of all
  of it (`.<start>~<hash>.lock`), the same for every writer; a longer name than the filesystem allows is refused
  in one line;
- an `overwrite` replaces only what looks like an earlier output (holds one of `expected`) unless it is
  `"force"`, checked at the start and again on what the final rename moves aside, and never the current working
  directory or a protected source;
- the lock file is opened without following links (`O_NOFOLLOW`) and must be a regular file of one name, so a
  link (symbolic or hard) planted in its place cannot make a writer overwrite another file;
- the filesystem's root, a directory directly under it, and the home directory and its parents are never replaced;
- a destination that is (or lies under) a link to nothing is refused: followed, the output would be written where
  the link leads, folders created on the way. A link to an existing directory is followed.
"""

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import signal
import stat
import tempfile
import threading
import time
from pathlib import Path

FORCE = "force"


def overwrite_from_flags(count: int) -> bool | str:
    """The `overwrite` of a command line's `--overwrite` given `count` times: once replaces an earlier output,
    twice (FORCE) any directory."""
    return FORCE if count > 1 else bool(count)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"terminated by signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM unwinds like Ctrl-C (so cleanups run: the staging below, a command's one-line exit); the previous
    handler is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def writes_on_this_rank(is_main_process: bool = True) -> bool:
    """Whether this process writes a saved folder: `is_main_process`, and rank 0 where torch.distributed is
    initialized (where every rank calls the save, as transformers' `save_pretrained` decides it)."""
    import torch.distributed as dist

    return is_main_process and not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> None:
    """`tokenizer.save_pretrained(directory)`, a failure of the disk raised as the OSError it is: the tokenizers
    library raises a bare Exception ("No space left on device (os error 28)"), which the commands' one-line errors
    did not take (a traceback, exit status 1)."""
    try:
        tokenizer.save_pretrained(directory)
    except OSError:
        raise
    except Exception as error:
        code = re.search(r"\(os error (\d+)\)", str(error))
        if code is None:
            raise
        raise OSError(int(code.group(1)), f"the tokenizer could not be written: {' '.join(str(error).split())}"
                      ) from error


class InterruptedAfterWriting(KeyboardInterrupt):
    """Ctrl-C or SIGTERM taken while `atomic_directory` replaced its destination, raised once the renames were
    done: the new output is in place (`path`), which a command's "interrupted" line must say."""

    def __init__(self, path: Path):
        super().__init__(f"interrupted after {str(path)!r} was written")
        self.path = path


@contextlib.contextmanager
def signals_deferred():
    """Ctrl-C and SIGTERM wait until the block is done (and are raised right after it): the two renames that
    replace an output must not be cut between them, which would leave neither the old output nor the new one.
    (Python runs signal handlers in the main thread; blocking the signals there would not stop other threads from
    receiving them, so the handlers themselves are swapped for ones that only take note.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            signal.raise_signal(received[0])  # now, through the handler that was in place


# What the name of a staging directory adds to the stem (`_stem`) it is named after, at most: `.` + `.<pid>.` (10
# digits: any pid) + 8 random characters + `.tmp` (or `.old`). The lock file's `.` + `.lock` and `_put_back`'s
# `.kept.` + 8 characters add less.
_ADDED = 1 + 1 + 10 + 1 + 8 + 4
_DIGEST = 16  # hex digits of the hash in a shortened stem: 64 bits, no two destinations' stems meet by chance


def _name_max(directory: Path) -> int:
    """The longest name, in bytes, that the filesystem of `directory` (or of its nearest existing parent) allows."""
    for path in (directory, *directory.parents):
        if os.path.isdir(path):
            with contextlib.suppress(OSError, ValueError):
                limit = os.pathconf(path, "PC_NAME_MAX")
                if limit > 0:
                    return limit
            break
    return 255  # Linux's NAME_MAX, where the filesystem does not say


def _stem(dst: Path, name: str = "destination") -> str:
    """What the names of `dst`'s lock file and staging directories are made of: its name, or where that would make
    them longer than the filesystem allows (a valid name of 231 bytes or more, of 255), the start of its name and a
    hash of all of it. Depends on `dst` only (and its filesystem), so that every writer of `dst` finds the same lock
    file and recognises the others' staging directories."""
    limit, encoded = _name_max(dst.parent), os.fsencode(dst.name)
    if len(encoded) + _ADDED <= limit:
        return dst.name
    room = limit - _ADDED - 1 - _DIGEST
    if room < 0:
        raise ValueError(f"{name} {str(dst)!r}: its filesystem allows names of {limit} bytes only; the hidden "
                         f"staging directories written next to it need {_ADDED + 1 + _DIGEST}; write it elsewhere")
    # Cut at a character, not inside one: the staging path must stay UTF-8 (safetensors and tokenizers write in it).
    start = encoded[:room].decode("utf-8", errors="ignore")
    return f"{start}~{hashlib.sha256(encoded).hexdigest()[:_DIGEST]}"


def _hidden_directory(parent: Path, prefix: str, suffix: str) -> Path:
    """A new directory `<prefix><8 random characters><suffix>` in `parent`, private to the user (as mkdtemp makes
    it). Named here, not by mkdtemp, whose random part is not documented: `_remove_stale_staging` must recognise
    these names exactly, and nothing else."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free name {prefix}<random>{suffix} in {str(parent)!r}")


def open_lock_file(path: Path, what: str) -> int:
    """A descriptor of the lock file `path`, created if missing. Opened without following links (`O_NOFOLLOW`) and
    refused unless a regular file of one name: a link planted there (symbolic, or a hard link to another file) must
    not make a writer write into the file it leads to. ValueError naming `what` (what the lock guards)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:  # a read-only or foreign parent, or a link: found before any work is done
        if error.errno == errno.ELOOP:
            raise ValueError(f"{what}: its lock file {str(path)!r} is a symbolic link, which no writer makes; "
                             f"remove it") from None
        raise ValueError(f"{what} cannot be written: {error}") from error
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:  # (0 names: its holder just removed it, see the caller)
        os.close(fd)
        kind = ("not a regular file" if not stat.S_ISREG(info.st_mode)
                else f"a file of {info.st_nlink} names (a hard link)")
        raise ValueError(f"{what}: its lock file {str(path)!r} is {kind}, which no writer makes; remove it")
    return fd


@contextlib.contextmanager
def _exclusive_lock(dst: Path, name: str, stem: str):
    """Hold `.<stem>.lock` next to `dst` (flock, exclusive, not waiting); removed when released. The kernel releases
    it when its holder dies, however (SIGKILL included): held, it proves that no other writer of `dst` runs."""
    path = dst.parent / f".{stem}.lock"
    while True:
        fd = open_lock_file(path, f"{name} {str(dst)!r}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ValueError(f"{name} {str(dst)!r} is being written by another process (pid {holder}, lock "
                             f"{str(path)!r}); wait for it to finish or choose another {name}") from None
        # The holder before us may have removed the file after we opened it: then lock the new one instead.
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        path.unlink(missing_ok=True)  # while still locked, so no other writer holds a lock on an unlinked file
        os.close(fd)


def _remove_stale_staging(dst: Path, stem: str) -> None:
    """Remove the `.<stem>.<pid>.<random>.tmp` (staging) and `.old` (replaced output) directories of `dst` that a
    killed writer left (SIGKILL, the OOM killer, a power cut). Called with the lock held: every writer makes its
    directories after it took the lock and removes them before it releases it (the kernel releases it when its
    holder dies), so any found now is a dead writer's, whatever the pid in its name. That pid proves nothing: a
    container's writer is PID 1 on every run (this very process's pid, then), and pids are reused; judged by it, a
    dead writer's directories were kept for ever, and the output it had moved aside was never put back.
    A writer killed between the two renames of a replacement (`_replace`) left `dst` missing and the output it was
    replacing in its `.old`: that output is put back first (the replacement never finished), not removed with it.
    (Put back by its own name: a shortened stem (`_stem`) that another destination's name equals shares its lock.)"""
    # Exactly the names writers make (a pid of at most 10 digits, 8 random characters), so that no other directory
    # is taken for one: the lock proves that no writer of `dst` runs, not that a look-alike name is a writer's.
    pattern = re.compile(rf"\.{re.escape(stem)}\.\d{{1,10}}\.[a-z0-9_]{{8}}\.(tmp|old)")
    for path in list(dst.parent.iterdir()):
        if not pattern.fullmatch(path.name) or not path.is_dir() or path.is_symlink():
            continue
        if path.name.endswith(".old"):
            for replaced in list(path.iterdir()):
                target = dst.parent / replaced.name
                if (replaced.is_dir() and not replaced.is_symlink() and not (target.exists() or target.is_symlink())
                        and _stem(target) == stem):
                    replaced.rename(target)
        shutil.rmtree(path, ignore_errors=True)


def check_utf8_path(path: str | os.PathLike, name: str) -> None:
    """A checkpoint's path (source or output) must be valid UTF-8: safetensors opens, and tokenizers writes, UTF-8
    paths only. A name the shell passed as other bytes failed deep inside them ("surrogates not allowed", or a shard
    "not valid UTF-8"), after the work was done, or left an output that no one could load."""
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} {os.fsencode(path)!r} is not valid UTF-8: safetensors and tokenizers, which read "
                         f"and write checkpoints, take UTF-8 paths only; use a UTF-8 name") from None


def check_destination(dst: str | os.PathLike, overwrite: bool | str = False, protect: tuple = (),
                      name: str = "destination", expected: tuple[str, ...] = ()) -> Path:
    """Refuse, before any work, a `dst` that `atomic_directory` would refuse; returns it resolved. Every directory
    written here is a checkpoint (a model, an adapter) that safetensors must open again: its path must be UTF-8."""
    check_utf8_path(dst, name)
    _check_name_lengths(dst, name)
    for path in (Path(dst), *Path(dst).parents):  # followed, it would write where it leads, creating folders there
        if path.is_symlink() and not path.exists():
            raise ValueError(f"{name} {str(dst)!r}: {str(path)!r} is a link to nothing ({os.readlink(path)!r}); "
                             f"remove it or make it lead to a directory")
    dst, protect = _resolved(dst, name), [_resolved(p, "source") for p in protect]
    for path in protect:
        if dst == path or path in dst.parents or dst in path.parents:
            raise ValueError(f"{name} {str(dst)!r} must not be, contain or lie inside the source {str(path)!r}")
    try:
        cwd = Path.cwd().resolve()
    except FileNotFoundError:  # the working directory was deleted: it is nowhere dst could be
        cwd = None
    if cwd is not None and (dst == cwd or dst in cwd.parents):
        raise ValueError(f"{name} {str(dst)!r} is (or contains) the current working directory: the output "
                         f"replaces it by a rename, which would leave this shell in a deleted directory; "
                         f"run from another directory")
    existing = next((p for p in [dst, *dst.parents] if p.exists() or p.is_symlink()), None)
    if existing is not None and not existing.is_dir():
        what = "exists" if existing == dst else f"lies under {str(existing)!r}, which exists"
        raise ValueError(f"{name} {str(dst)!r} {what} and is not a directory")
    if dst.is_dir() and any(dst.iterdir()):
        if _too_wide(dst):
            raise ValueError(f"{name} {str(dst)!r} is the filesystem's root, a directory directly under it, or the "
                             f"home directory or one of its parents: never replaced, not even with "
                             f"overwrite='force'; choose a directory of its own")
        if not overwrite:
            raise ValueError(f"{name} {str(dst)!r} exists and is not empty; pass overwrite=True (--overwrite) "
                             f"to replace it")
        if expected and overwrite != FORCE and not any((dst / file).exists() for file in expected):
            raise ValueError(f"{name} {str(dst)!r} is not empty and holds no {' or '.join(expected)}, so it is not "
                             f"an earlier output: refusing to replace it; pass overwrite='force' (--overwrite "
                             f"twice) to replace it anyway")
    return dst


def check_writable(dst: str | os.PathLike, name: str = "destination") -> None:
    """Refuse, before any work, a `dst` whose staging directory could not be made: `atomic_directory` stages next to
    `dst`, in its nearest existing parent (it creates the rest), then renames it over `dst`. Tried, not inferred from permissions: root ignores
    them, and read-only mounts and immutable folders do not show in them. A command that trains or evaluates for
    hours calls it first, so that an unwritable destination is not found only when the results are ready. A link is
    followed, as `atomic_directory` follows it: the staging goes next to where it leads."""
    given, dst = dst, _resolved(dst, name)
    parent = next(p for p in dst.parents if p.exists())
    # An existing dst is tried too: a rename replaces it, which an immutable (chattr +i) or read-only one refuses;
    # a command that puts its files into an existing folder writes there.
    for directory in (parent, *([dst] if dst.is_dir() else [])):
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=directory))
        except OSError as error:
            raise ValueError(f"{name} {str(given)!r} cannot be written: {' '.join(str(error).split())}") from None


def _check_name_lengths(dst: str | os.PathLike, name: str) -> None:
    """The folders of `dst` still to be created must have names that their filesystem allows (255 bytes on most):
    a longer one failed with a bare "[Errno 36] File name too long" from wherever it was first looked at."""
    path, new = Path(os.path.abspath(dst)), []
    while not os.path.lexists(path) and path != path.parent:  # (lexists is False for a name too long, too)
        new.append(path.name)
        path = path.parent
    limit = _name_max(path)
    for part in new:
        if len(os.fsencode(part)) > limit:
            raise ValueError(f"{name} {str(dst)!r}: a name in it is {len(os.fsencode(part))} bytes long, and its "
                             f"filesystem allows at most {limit} bytes per name; choose a shorter name")


def _resolved(path, name: str) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError) as error:  # a loop of links (RuntimeError before Python 3.13)
        raise ValueError(f"{name} {str(path)!r} cannot be resolved: {error}") from None


def _too_wide(dst: Path) -> bool:
    """Whether replacing `dst` would replace far more than an output: /, /usr, /home, the home directory, ..."""
    root = Path(dst.anchor)
    try:
        home = Path.home().resolve()
    except (KeyError, RuntimeError, OSError):  # no home directory known
        home = None
    return dst == root or dst.parent == root or (home is not None and (dst == home or dst in home.parents))


@contextlib.contextmanager
def locked_staging(dst: Path, name: str, wait_seconds: float = 0.0):
    """Yield a new private staging directory next to `dst` (`.<stem>.<pid>.<random>.tmp`), holding for the whole
    block the lock that every writer of `dst` takes (`atomic_directory`'s), and having removed what a killed writer
    left. Waits up to `wait_seconds` for another writer to release the lock; then (or at once, by default) the
    ValueError naming `dst` and that writer's pid. The staging directory is removed when the block fails; when it
    succeeds, the block has renamed it away or moved its files out (it is then removed), or left them there to keep
    them (it is then left, and its path is the caller's to report). For a writer that moves its files into `dst`
    itself, into a folder of other outputs (`modeling_diff.needle`): the renames go under `signals_deferred`."""
    stem = _stem(dst, name)
    deadline = time.monotonic() + wait_seconds
    with contextlib.ExitStack() as stack:
        while True:
            try:
                stack.enter_context(_exclusive_lock(dst, name, stem))
                break
            except ValueError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
        _remove_stale_staging(dst, stem)
        staging = _hidden_directory(dst.parent, f".{stem}.{os.getpid()}.", ".tmp")
        try:
            yield staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        with contextlib.suppress(OSError):  # gone if renamed away; kept if the block left files in it on purpose
            staging.rmdir()


@contextlib.contextmanager
def atomic_directory(dst: str | os.PathLike, overwrite: bool | str = False, protect: tuple = (),
                     name: str = "destination", expected: tuple[str, ...] = ()):
    """Yield an empty temporary directory next to `dst`; when the block succeeds it replaces `dst` (renames), when
    it fails (or is interrupted, SIGTERM included) it is removed. An existing non-empty `dst` is replaced only with
    `overwrite=True`, and then only if it holds one of the files `expected` (when given) or `overwrite="force"`;
    `dst` may not be, contain or lie inside any path of `protect` (a source that is only read), nor be the working
    directory. `name` names `dst` in errors. Raises ValueError (naming `dst`) for every refusal."""
    dst = check_destination(dst, overwrite, protect, name, expected)
    created = [p for p in [dst.parent, *dst.parent.parents] if not p.exists()]
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{name} {str(dst)!r}: cannot create its parent directory: {error}") from error
    try:
        with sigterm_as_interrupt(), locked_staging(dst, name) as staging:
            if check_destination(dst, overwrite, protect, name, expected) != dst:  # again, now that we hold the lock
                # A link put on its way meanwhile: the lock held would not be the one that guards where it leads.
                raise ValueError(f"{name} {str(dst)!r} came to lead elsewhere (a link on its path) while it was "
                                 f"being locked; nothing was written")
            yield staging
            staging.chmod(0o755)  # made private to the user
            replaced = False
            try:
                with signals_deferred():
                    _replace(staging, dst, overwrite, name, expected)
                    replaced = True
            except KeyboardInterrupt as interrupt:  # taken during the renames, raised after them
                if replaced:
                    raise InterruptedAfterWriting(dst) from interrupt
                raise
    except BaseException:
        for path in created:  # parents this call created, if still empty
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


def _replace(staging: Path, dst: Path, overwrite: bool | str, name: str, expected: tuple[str, ...]) -> None:
    """Rename `staging` to `dst`. Without `overwrite` the rename itself refuses a non-empty `dst`; with it, what is
    replaced is checked once moved aside (not only at the start: someone may have put another directory there
    meanwhile), and put back unless it is empty or, without "force", holds one of `expected`."""
    if not overwrite or not dst.exists():
        try:
            staging.rename(dst)  # replaces at most an empty directory, atomically
        except OSError as error:
            if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                retry = "" if overwrite else " (pass overwrite=True to replace it)"
                raise ValueError(f"{name} {str(dst)!r} was created by someone else while this one was being "
                                 f"written; it was left as it is and this output discarded{retry}") from error
            raise ValueError(f"{name} {str(dst)!r} could not be written: {error}") from error
        return
    stem = _stem(dst, name)
    old = _hidden_directory(dst.parent, f".{stem}.{os.getpid()}.", ".old")
    try:
        try:
            dst.rename(old / dst.name)
        except OSError as error:
            hint = " (is it a mount point?)" if error.errno in (errno.EBUSY, errno.EXDEV) else ""
            raise ValueError(f"{name} {str(dst)!r} could not be replaced{hint}: {error}; it was left as "
                             f"it is") from error
        replaced = old / dst.name
        if not replaced.is_dir() or replaced.is_symlink():
            _put_back(replaced, dst, old, name, stem)
            raise ValueError(f"{name} {str(dst)!r} became something other than a directory while this one was being "
                             f"written; it was left as it is and this output discarded")
        if expected and overwrite != FORCE and any(replaced.iterdir()) and not any(
                (replaced / file).exists() for file in expected):
            _put_back(replaced, dst, old, name, stem)
            raise ValueError(f"{name} {str(dst)!r} was replaced while this one was being written by a directory "
                             f"holding no {' or '.join(expected)}, so not an earlier output; it was left as it is "
                             f"and this output discarded (overwrite='force', --overwrite twice, replaces it)")
        try:
            staging.rename(dst)
        except OSError as error:
            _put_back(replaced, dst, old, name, stem)
            raise ValueError(f"{name} {str(dst)!r} could not be replaced: {error}; it was left as it is") from error
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _put_back(replaced: Path, dst: Path, old: Path, name: str, stem: str) -> None:
    """Rename the directory moved aside to `replaced` back to `dst`. Should `dst` have been created again in
    between, it is kept where it is (outside `old`, which the caller removes) and the error says where. (Named after
    the stem: `<name>.kept.<random>` may be longer than the filesystem allows, and failing here would lose it.)"""
    try:
        replaced.rename(dst)
    except OSError as error:
        kept = Path(tempfile.mkdtemp(prefix=f"{stem}.kept.", dir=dst.parent))
        replaced.rename(kept / dst.name)
        raise ValueError(f"{name} {str(dst)!r} was created again while being restored ({error}); what it held "
                         f"before is kept in {str(kept / dst.name)!r}") from error


__all__ = ["FORCE", "InterruptedAfterWriting", "atomic_directory", "check_destination", "check_writable",
           "locked_staging", "open_lock_file", "overwrite_from_flags", "save_tokenizer", "signals_deferred",
           "sigterm_as_interrupt", "writes_on_this_rank"]
