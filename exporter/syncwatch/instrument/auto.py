"""Zero-code-change instrumentation: what ``syncwatch-run`` installs into an unmodified script.

``install()`` (run from the ``sitecustomize`` that ``syncwatch-run`` puts on ``PYTHONPATH``)
waits for the program to import ``torch.nn.parallel.distributed`` and then patches
``DistributedDataParallel.__init__`` and ``forward``. When a DDP model is built with
``torch.distributed`` initialized (all ranks build it, so the side group of the skew exchange
can be created there):

* ``syncwatch.instrument.init()`` runs (identity from the launcher's environment);
* the gradient wait is measured hook-free (``hooks.watch_gradients``): DDP keeps its built-in
  all-reduce, or whatever comm hook the script registers (Python or built-in C++);
* the torch.distributed collectives are wrapped (sequence numbers, waits outside DDP);
* phases come from DDP's patched ``forward`` and from optimizer hooks: ``forward`` = the DDP
  module's forward, ``optimizer`` = the optimizer's ``step()``, ``backward`` = from the end of
  forward to the optimizer step (loss, backward, gradient clipping), ``data`` = from the
  optimizer step to the next forward (loading, zero_grad, host-to-device copies); ``sync`` =
  the measured collective waits, taken out of the others;
* a step ends after each ``step()`` of the first optimizer that steps; samples = the batch
  dimension of the first tensor given to forward, summed over the forwards of the step.

Not visible without the explicit API: tokens, checkpoints, the job's own step numbers (hence
re-run steps after a restart), custom phases, and anything a second optimizer does.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys

from . import _state

log = logging.getLogger("syncwatch.instrument")

TARGET = "torch.nn.parallel.distributed"


def install() -> None:
    """Patch DDP now if it is imported, else as soon as it is. Never raises."""
    try:
        if TARGET in sys.modules:
            _patch_ddp_module(sys.modules[TARGET])
        elif not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    except Exception:
        log.warning("syncwatch: zero-code instrumentation not installed", exc_info=True)


class _Finder(importlib.abc.MetaPathFinder):
    """Lets the real finders load ``TARGET`` and patches it right after it executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module):
            real_exec(module)
            try:
                _patch_ddp_module(module)
            except Exception:
                log.warning("syncwatch: could not patch DDP", exc_info=True)
        loader.exec_module = exec_module
        return spec


def _patch_ddp_module(module) -> None:
    """Patch the class, once: ``__init__`` attaches each new model, ``forward`` switches the
    phases of an attached one. Forward hooks would do the latter without a patch, but a module
    with hooks leaves ``nn.Module``'s fast call path: +18–19 k instructions a step, against a
    wrapper's one frame (``benchmarks/instrument_instructions.py``)."""
    ddp_cls = module.DistributedDataParallel
    if getattr(ddp_cls, "_syncwatch_patched", False):
        return
    orig_init, orig_forward = ddp_cls.__init__, ddp_cls.forward

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        try:
            _attach(self)
        except Exception:
            log.warning("syncwatch: could not instrument this DDP model", exc_info=True)

    @functools.wraps(orig_forward)
    def forward(self, *inputs, **kwargs):
        steps = self.__dict__.get(ATTACHED)
        if steps is None:
            return orig_forward(self, *inputs, **kwargs)
        steps.forward_pre(inputs)
        out = orig_forward(self, *inputs, **kwargs)
        steps.forward_post()
        return out

    ddp_cls.__init__ = __init__
    ddp_cls.forward = forward
    ddp_cls._syncwatch_patched = True


class _Steps:
    """Phase switching driven by DDP's patched forward and optimizer hooks (one per process)."""

    def __init__(self, monitor):
        self.m = monitor
        self.cur = None
        self.optimizer_id = None
        self.samples = 0
        self.switch("data")

    def switch(self, name: str | None) -> None:
        if self.cur is not None:
            self.cur.__exit__(None, None, None)
            self.cur = None
        if name is not None:
            self.cur = self.m.phase(name)
            self.cur.__enter__()

    def forward_pre(self, args):
        if _state.monitor is not self.m:
            return
        try:
            for a in args:
                if getattr(a, "ndim", 0):  # the first tensor that has a batch dimension
                    self.samples += int(a.shape[0])
                    break
            self.switch("forward")
        except Exception:
            self.m._error()

    def forward_post(self):
        if _state.monitor is self.m:
            self.switch("backward")

    def optimizer_pre(self, optimizer, args, kwargs):
        if _state.monitor is not self.m:
            return
        if self.optimizer_id is None:
            self.optimizer_id = id(optimizer)
        if id(optimizer) == self.optimizer_id:
            self.switch("optimizer")

    def optimizer_post(self, optimizer, args, kwargs):
        if _state.monitor is not self.m or id(optimizer) != self.optimizer_id:
            return
        self.switch(None)
        self.m.step(self.samples)
        self.samples = 0
        self.switch("data")


_steps: _Steps | None = None
ATTACHED = "_syncwatch_steps"  # a DDP model's attribute: the _Steps its forward drives


def _attach(ddp) -> None:
    global _steps
    import syncwatch.instrument as sw
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    monitor = sw.init()
    if monitor is None:
        return
    if _steps is None or _steps.m is not monitor:
        _steps = _Steps(monitor)
        sw.register(collectives=True)
        register_optimizer_step_pre_hook(_steps.optimizer_pre)
        register_optimizer_step_post_hook(_steps.optimizer_post)
    sw.register(ddp, collectives=False)
    ddp.__dict__[ATTACHED] = _steps
