"""Registrations with an optional package that run when the package is imported, now or later.

An exported remote-code folder (`remote_code.py`) adds "diff_llama" to dicts of PEFT (its default target modules)
and Liger (its model-type dispatch). Importing PEFT (5.5 s) or liger-kernel (3.4 s) only to add it would cost every
user who uses neither, so it is added where the package is imported already, and otherwise as soon as it is. Added
only where the package was imported before the model was built, it missed the common order: the model loaded first,
then `from peft import ...` in the next cell (PEFT asked for `target_modules`), or Trainer's `use_liger_kernel=True`
importing Liger (which patched nothing).
"""

import importlib.abc
import sys
import threading
import warnings
from collections.abc import Callable

_WAITING: dict[str, list[Callable[[], None]]] = {}  # module name -> what runs once it has been executed
_LOCK = threading.Lock()


def call_when_imported(module_name: str, callback: Callable[[], None]) -> None:
    """Call `callback` now if `module_name` is imported, else right after its import executes it (once, however
    many times this is asked)."""
    if module_name in sys.modules:
        callback()
        return
    with _LOCK:
        waiting = _WAITING.setdefault(module_name, [])
        if callback not in waiting:
            waiting.append(callback)
        if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: the spec of a waited-for module comes from the finders after it, with its loader
    wrapped so that the callbacks run after the module's code."""

    def find_spec(self, fullname, path, target=None):
        with _LOCK:
            callbacks = _WAITING.pop(fullname, None)
        if callbacks is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenCall(spec.loader, callbacks)
                return spec
        return None


class _ThenCall(importlib.abc.Loader):
    """The module's own loader, then the callbacks. A callback that fails warns: the user's import goes on."""

    def __init__(self, loader, callbacks: list[Callable[[], None]]):
        self._loader, self._callbacks = loader, callbacks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in self._callbacks:
            try:
                callback()
            except Exception as error:  # noqa: BLE001 (the package imported; only our registration is missing)
                warnings.warn(f"modeling_diff could not register with {module.__name__}: {error!r}", stacklevel=2)

    def __getattr__(self, name):  # get_source, is_package, get_resource_reader: the module's own loader answers
        return getattr(self._loader, name)


__all__ = ["call_when_imported"]
