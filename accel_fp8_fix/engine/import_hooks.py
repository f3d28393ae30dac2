"""Post-import hooks with the standard library only: ``import accel_fp8_fix`` must not pay for wrapt's
importer (it pulls asyncio) before accelerate is even imported.

``when_imported(name, callback)`` calls ``callback(module)`` right after ``name`` finishes importing, or
at once if it already is. A meta-path finder asks the other finders for the real spec and wraps that
loader's ``exec_module``; it never imports anything itself.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.RLock()
_pending: dict = {}  # module name -> [callback]


class _PostImportFinder:  # a meta-path finder (importlib.abc would cost ~15 ms of imports)
    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        real_exec = loader.exec_module

        def exec_module(module):
            real_exec(module)
            with _lock:
                callbacks = _pending.pop(fullname, [])
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module
        return spec


_finder = _PostImportFinder()


def when_imported(name: str, callback) -> None:
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    callback(module)
