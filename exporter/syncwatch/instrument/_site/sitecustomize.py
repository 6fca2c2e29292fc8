"""Put on PYTHONPATH by ``syncwatch-run``: installs zero-code instrumentation in every Python
process of the command (cheap: torch is patched only if and when the program imports DDP or
FSDP), then runs the ``sitecustomize`` this one shadows, if there is one.

The program's own syncwatch is used where its environment has one; otherwise the one
``syncwatch-run`` came from, loaded from ``SYNCWATCH_PACKAGE_ROOT`` without putting that
directory on ``sys.path`` (it is a whole ``site-packages``: its other packages would shadow the
program's). Nothing here may stop the program from starting: a failure is one line on stderr."""

import importlib.machinery
import importlib.util
import os
import sys


def _load_syncwatch() -> bool:
    """Make ``syncwatch`` importable; False where neither environment has it."""
    if importlib.util.find_spec("syncwatch") is not None:
        return True
    root = os.environ.get("SYNCWATCH_PACKAGE_ROOT")
    spec = importlib.machinery.PathFinder.find_spec("syncwatch", [root]) if root else None
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["syncwatch"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["syncwatch"]
        raise
    return True


try:
    if _load_syncwatch():
        from syncwatch.instrument import auto

        auto.install()
    else:
        print("syncwatch-run: syncwatch not found (SYNCWATCH_PACKAGE_ROOT="
              f"{os.environ.get('SYNCWATCH_PACKAGE_ROOT')!r}): this process is not instrumented",
              file=sys.stderr)
except Exception as e:
    print(f"syncwatch-run: this process is not instrumented: {e!r}", file=sys.stderr)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


try:
    _chain()
except Exception as e:  # said as Python says it of a sitecustomize of its own: not silenced
    if sys.flags.verbose:
        sys.excepthook(*sys.exc_info())
    else:
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
              f"{type(e).__name__}: {e}", file=sys.stderr)
