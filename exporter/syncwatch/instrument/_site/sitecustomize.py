"""Put on PYTHONPATH by ``syncwatch-run``: installs zero-code instrumentation in every Python
process of the command (cheap: torch is patched only if and when the program imports DDP or
FSDP), then runs the ``sitecustomize`` this one shadows, if there is one."""

import importlib.machinery
import importlib.util
import os
import sys

try:
    from syncwatch.instrument import auto

    auto.install()
except Exception:  # never stop the program from starting
    pass


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


try:
    _chain()
except Exception:
    pass
