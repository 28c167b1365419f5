"""What `ah.launch`'s spawn start method (the default on CUDA) needs: the rank function
and its arguments reached from a fresh interpreter.

A spawned rank starts a new Python, so `main` and `args` travel pickled: `main` by
name. Refused before any process starts, naming the function: a lambda, a nested
function, one defined in an interactive session's ``__main__`` (no file to load it
from), arguments that do not pickle.

The launching script itself: multiprocessing would run it again in every rank as
``__mp_main__``, and a script that calls ``ah.launch`` at its top level without an
``if __name__ == "__main__":`` guard (the README's example) would then launch again
from inside a rank. So ranks are started with the script hidden from multiprocessing
(`script_hidden`), and a rank that needs it (``main`` or a pickled argument lives in
``__main__``) runs the script itself (`load_script`) as ``__mp_main__`` up to its
first ``ah.launch`` call, which stops there (`StopAtLaunch`): everything defined
above the call exists, nothing after it runs, an ``if __name__ == "__main__":`` block
does not run (a function defined inside one cannot be found, and the rank says so).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import sys
import types
from typing import Any, Callable, Iterator, NamedTuple

from ..errors import ClusterError

__all__ = ["start_method_for", "ScriptRef", "Pickled", "StopAtLaunch", "spawn_target",
           "resolve", "script_hidden", "load_script", "loading_script"]


def start_method_for(device_type: str, start_method: str | None) -> str:
    """`start_method`, or the default: spawn on CUDA (a rank needs CUDA of its own; the
    launching process may have initialized it), fork on CPU (ranks inherit the imports)."""
    if start_method is None:
        return "spawn" if device_type == "cuda" else "fork"
    if start_method not in mp.get_all_start_methods():
        raise ClusterError(f"launch: start_method must be one of "
                           f"{mp.get_all_start_methods()} or None, got {start_method!r}")
    return start_method


class ScriptRef(NamedTuple):
    """The launching script (`path`; `package`: its module name under ``python -m``) and,
    when `main` is defined in it, main's name there (`qualname`, else None)."""

    path: str
    package: str | None
    qualname: str | None


class Pickled(NamedTuple):
    """`main` (a function, or None when it is found in the script) and the pickled args."""

    main: Any
    args: bytes
    script: ScriptRef | None


class StopAtLaunch(BaseException):
    """Raised by `ah.launch` while a spawned rank loads the launching script."""


_LOADING = [False]


def loading_script() -> bool:
    """True while a spawned rank runs the launching script (ah.launch then stops it)."""
    return _LOADING[0]


def _describe(main: Callable[..., Any]) -> str:
    return f"{getattr(main, '__module__', '?')}.{getattr(main, '__qualname__', repr(main))}"


def spawn_target(main: Callable[..., Any], args: tuple) -> Pickled:
    """`main` and `args` ready for a spawned rank, or a ClusterError naming `main`."""
    what = _describe(main)
    hint = ("define it with def at the top level of a module or script, or pass "
            "start_method='fork' (CPU clusters, or CUDA not yet initialized in this process)")
    qualname = getattr(main, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ClusterError(f"launch(start_method='spawn'): the rank function {what} is a "
                           f"lambda or a nested function, which a new process cannot "
                           f"import: {hint}")
    top = sys.modules.get("__main__")
    path = getattr(top, "__file__", None)
    spec = getattr(top, "__spec__", None)
    script = (ScriptRef(os.path.abspath(path), getattr(spec, "name", None), None)
              if path and os.path.isfile(path) else None)
    in_main = getattr(main, "__module__", None) == "__main__"
    if in_main:
        if script is None:
            raise ClusterError(f"launch(start_method='spawn'): the rank function {what} is "
                               f"defined in an interactive session (its __main__ has no "
                               f"file), which a new process cannot load: put it in a .py "
                               f"file and import it, or {hint.split(', or ')[1]}")
        if _lookup(top, qualname) is not main:
            raise ClusterError(f"launch(start_method='spawn'): the rank function {what} is "
                               f"not reachable by its name in the script: {hint}")
        script = script._replace(qualname=qualname)
    else:
        try:
            pickle.dumps(main)
        except Exception as exc:  # noqa: BLE001 - any pickling failure names main
            raise ClusterError(f"launch(start_method='spawn'): the rank function {what} "
                               f"cannot be pickled for a new process ({exc}): {hint}") from None
    try:
        payload = pickle.dumps(args)
    except Exception as exc:  # noqa: BLE001
        raise ClusterError(f"launch(start_method='spawn'): the args for {what} cannot be "
                           f"pickled for a new process ({type(exc).__name__}: {exc}); pass "
                           f"picklable values (tensors, numbers, configs), or "
                           f"start_method='fork'") from None
    needs_script = in_main or b"__main__" in payload
    return Pickled(None if in_main else main, payload, script if needs_script else None)


def _lookup(module: Any, qualname: str) -> Any:
    value = module
    for part in qualname.split("."):
        value = getattr(value, part, None)
    return value


@contextlib.contextmanager
def script_hidden() -> Iterator[None]:
    """While ranks are spawned: multiprocessing sees a ``__main__`` without a file, so
    the ranks do not run the launching script (they load it themselves: `resolve`)."""
    real = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real


def load_script(script: ScriptRef) -> types.ModuleType:
    """Run the launching script as ``__mp_main__`` up to its first ``ah.launch`` call and
    install it as ``__main__`` (in a spawned rank)."""
    module = types.ModuleType("__mp_main__")
    module.__file__ = script.path
    if script.package:
        module.__package__ = script.package.rpartition(".")[0]
    with open(script.path, encoding="utf-8") as f:
        code = compile(f.read(), script.path, "exec")
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    _LOADING[0] = True
    try:
        exec(code, module.__dict__)  # noqa: S102 - the user's own script, as spawn runs it
    except StopAtLaunch:
        pass
    finally:
        _LOADING[0] = False
    return module


def resolve(main: Any, args: Any) -> tuple[Callable[..., Any], tuple]:
    """In a rank: the function and args `spawn_target` prepared (a fork's pass through)."""
    if not isinstance(args, Pickled):
        return main, args
    if args.script is not None:
        module = load_script(args.script)
        if args.script.qualname is not None:
            main = _lookup(module, args.script.qualname)
            if not callable(main):
                raise ClusterError(
                    f"spawned rank: the rank function {args.script.qualname!r} is not "
                    f"defined in {args.script.path} before its ah.launch call (a spawned "
                    f"rank runs the script as __mp_main__ up to that call, so a function "
                    f"inside `if __name__ == '__main__':` is not seen): define it at the "
                    f"top level, above the launch")
    return (args.main if args.main is not None else main), pickle.loads(args.args)
