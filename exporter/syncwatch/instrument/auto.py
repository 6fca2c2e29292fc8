"""Zero-code-change instrumentation: what ``syncwatch-run`` installs into an unmodified script.

``install()`` (run from the ``sitecustomize`` that ``syncwatch-run`` puts on ``PYTHONPATH``)
waits for the program to import DDP or FSDP and then patches them (``PATCHES``):
``DistributedDataParallel.__init__`` and ``forward``, ``FullyShardedDataParallel.__init__`` and
``forward``, ``fully_shard``, the end-of-backward callbacks of both FSDPs,
``GradScaler.step``, ``Optimizer.load_state_dict``, and the checkpoint savers ``torch.save``,
``torch.distributed.checkpoint``'s ``save`` and ``async_save``, and ``safetensors.torch``'s
``save_file`` and ``save_model``. When a model is wrapped with
``torch.distributed`` initialized (all ranks wrap it, so the side group of the skew exchange can
be created there):

* ``syncwatch.instrument.init()`` runs (identity from the launcher's environment);
* the torch.distributed collectives are wrapped (sequence numbers, waits outside DDP; FSDP's
  all-gathers and reduce-scatters);
* a DDP model's gradient wait is measured hook-free (``hooks.watch_gradients``): DDP keeps its
  built-in all-reduce, or whatever comm hook the script registers (Python or built-in C++);
* phases come from the model's forward and from optimizer hooks: ``forward`` = the DDP
  module's forward (FSDP: the root's, the one wrapped last: FSDP wraps bottom-up),
  ``optimizer`` = the optimizer's ``step()``, ``backward`` = from the end of forward to the
  optimizer step (loss, backward, gradient clipping), ``data`` = from the optimizer step to the
  next forward (loading, zero_grad, host-to-device copies); ``sync`` = the measured collective
  waits, taken out of the others;
* with gradient accumulation (several forwards and backwards a step), what comes between the end
  of a DDP model's backward and the next forward of the step (the next micro-batch's loading)
  is ``data`` too, and what comes after the last backward until the optimizer step (clipping,
  unscaling) stays ``backward``: the hook-free gradient wait marks where each DDP backward ends
  (a synchronized one's final callback, and under ``no_sync()`` one final callback of its own),
  FSDP's wrapped end-of-backward callback where each FSDP backward ends, and a forward with no
  optimizer step since the one before ends ``backward`` with ``Monitor.next_micro_batch``, from
  which the records thread takes the time since the latest backward's end as ``data`` (this
  thread does not know where that was). A step without accumulation runs one comparison of it,
  at its forward;
* a step ends after each ``step()`` of the first optimizer that steps, or a ``GradScaler.step``
  of it that skipped ``step()`` (inf or NaN gradients); samples = the batch dimension of the
  first tensor given to forward (``batch_size``), summed over the step's forwards of the first
  model that runs one with autograd on (that optimizer or model once dropped: the next one, as
  in a second run in the same process); a forward with autograd off counts no samples: in
  eval mode (``model.eval()`` then ``torch.no_grad``: an evaluation) its time, until the next
  training forward, is ``eval``, a planned pause like a checkpoint; in train mode (a frozen
  teacher wrapped in DDP) it is ``other``;
* a save on the training thread once the loop has started (``torch.save``, DCP's ``save`` and
  the staging part of its ``async_save``, safetensors' ``save_file`` and ``save_model``) is
  ``checkpoint``, a planned pause; after it, the phase it interrupted goes on. A save before
  the first forward is setup, no step's;
* steps are numbered from 1 in each process, or, once the optimizer that ends the steps loads
  a state that counts its steps (``Optimizer.load_state_dict``: Adam's, AdamW's and most
  others' ``step``), from that count on: a job resuming from a checkpoint goes on with its own
  step numbers, and after a restart the daemon counts the steps run again.

Not visible without the explicit API: tokens, saves by other means (a file the script writes
itself, a thread of the script's own, a saver bound by ``from ... import`` before
``install()`` ran), the job's own step numbers where its optimizer keeps no step count (SGD:
after a restart from a checkpoint, every step of the attempt before reads as re-run), custom
phases, and steps ended by a second optimizer (its own ``step()`` is ``optimizer``, then
``data``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import weakref

from ..protocol import MAX_STEP
from . import _state

log = logging.getLogger("syncwatch.instrument")


def install() -> None:
    """Patch DDP and FSDP now where imported, else as soon as they are. Never raises; a patch
    that fails (a torch that moved what it wraps) leaves the others in place."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            try:
                patch(sys.modules[name])
            except Exception:
                log.warning("syncwatch: could not patch %s", name, exc_info=True)
    try:
        if set(PATCHES) - set(sys.modules) and not any(isinstance(f, _Finder)
                                                       for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    except Exception:
        log.warning("syncwatch: zero-code instrumentation not installed", exc_info=True)


class _Finder(importlib.abc.MetaPathFinder):
    """Lets the real finders load a module of ``PATCHES`` and patches it right after it
    executes (before the package that re-exports its names binds them)."""

    def find_spec(self, fullname, path, target=None):
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module):
            real_exec(module)
            try:
                patch(module)
            except Exception:
                log.warning("syncwatch: could not patch %s", fullname, exc_info=True)
        loader.exec_module = exec_module
        return spec


def _patch_ddp_module(module) -> None:
    _patch_class(module.DistributedDataParallel, _attach)


def _patch_fsdp_module(module) -> None:
    _patch_class(module.FullyShardedDataParallel, _attach_fsdp)


def _patch_class(cls, attach) -> None:
    """Patch the class, once: ``__init__`` attaches each new model, ``forward`` switches the
    phases of an attached one. Forward hooks would do the latter without a patch, but a module
    with hooks leaves ``nn.Module``'s fast call path: +18–19 k instructions a step, against a
    wrapper's one frame (``benchmarks/instrument_instructions.py``)."""
    if getattr(cls, "_syncwatch_patched", False):
        return
    orig_init, orig_forward = cls.__init__, cls.forward

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        try:
            attach(self)
        except Exception:
            log.warning("syncwatch: could not instrument this %s model", cls.__name__,
                        exc_info=True)

    @functools.wraps(orig_forward)
    def forward(self, *inputs, **kwargs):
        steps = self.__dict__.get(ATTACHED)
        if steps is None:
            return orig_forward(self, *inputs, **kwargs)
        steps.forward_pre(self, inputs, kwargs)
        out = orig_forward(self, *inputs, **kwargs)
        steps.forward_post()
        return out

    cls.__init__ = __init__
    cls.forward = forward
    cls._syncwatch_patched = True


def _patch_fully_shard_module(module) -> None:
    """Wrap ``fully_shard`` (FSDP2), once; ``functools.wraps`` keeps its ``state`` attribute.
    Where FSDP was imported before ``install()``, its packages' re-exports are rebound too."""
    orig = module.fully_shard
    if getattr(orig, "_syncwatch_original", None) is not None:
        return

    @functools.wraps(orig)
    def fully_shard(*args, **kwargs):
        out = orig(*args, **kwargs)
        try:
            mesh = kwargs.get("mesh")
            _attach_fsdp(out, whole_world=mesh is None or _spans_world(mesh.size()))
        except Exception:
            log.warning("syncwatch: could not instrument this fully_shard model", exc_info=True)
        return out

    _replace(module, "fully_shard", orig, fully_shard,
             ("torch.distributed.fsdp._fully_shard", "torch.distributed.fsdp"))


def _patch_fsdp_state_module(module) -> None:
    """FSDP2 queues its root's ``FSDPState._root_post_backward_final_callback`` (a bound method,
    looked up when queued) to run at the end of each backward, synchronized or not."""
    _mark_backward_end_after(module.FSDPState, "_root_post_backward_final_callback")


def _patch_fsdp_runtime_module(module) -> None:
    """``FullyShardedDataParallel`` queues ``_post_backward_final_callback`` (the module's
    global, looked up when queued) to run at the end of each backward, under ``no_sync()`` too."""
    _mark_backward_end_after(module, "_post_backward_final_callback")


def _mark_backward_end_after(owner, name: str) -> None:
    """Wrap FSDP's end-of-backward callback ``owner.name``, once, to mark where that backward
    ended (``Monitor.backward_ended``) once it has run: the time from there to the next
    micro-batch's forward, its loading, is then ``data``. DDP's backward ends are marked by the
    hook-free gradient wait; nothing marks FSDP's, whose loading between micro-batches read
    ``backward``. FSDP's own callback runs first and its errors are its own; none of ours
    reaches FSDP (the mark counts its own)."""
    orig = getattr(owner, name)
    if getattr(orig, "_syncwatch_original", None) is not None:
        return

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        orig(*args, **kwargs)
        m = _steps.m if _steps is not None and not _stood_down else None
        if m is not None and m is _state.monitor and m.backward_ended is not None:
            m.backward_ended()

    wrapper._syncwatch_original = orig
    setattr(owner, name, wrapper)


def _patch_optimizer_module(module) -> None:
    """Wrap ``Optimizer.load_state_dict``, once: a job resuming from a checkpoint loads its
    optimizer's state, and with it the count of steps taken (``loaded_step``). The next step
    is numbered from there (``_Steps.end_step``), so that after a restart the daemon counts
    the steps run again, not every step of the attempt before (each attempt counting from 1)."""
    cls = module.Optimizer
    orig = cls.load_state_dict
    if getattr(orig, "_syncwatch_original", None) is not None:
        return

    @functools.wraps(orig)
    def load_state_dict(self, state_dict, *args, **kwargs):
        out = orig(self, state_dict, *args, **kwargs)
        try:
            n = loaded_step(state_dict)
            if n is not None:
                _loaded[self] = n
        except Exception:
            if _steps is not None:
                _steps.error()
        return out

    load_state_dict._syncwatch_original = orig
    cls.load_state_dict = load_state_dict


def loaded_step(state_dict) -> int | None:
    """The number of steps an optimizer state counts: the ``step`` of its first parameter that
    has one (Adam, AdamW, RMSprop and most others keep one per parameter, all equal), else of
    its first parameter group that has one; None where it keeps none (SGD). A tensor on a GPU
    (a fused or capturable optimizer's) is read once, here, while the checkpoint loads."""
    if not isinstance(state_dict, dict):
        return None
    states, groups = state_dict.get("state"), state_dict.get("param_groups")
    holders = [*(states.values() if isinstance(states, dict) else ()),
               *(groups if isinstance(groups, (list, tuple)) else ())]
    for holder in holders:
        if isinstance(holder, dict) and "step" in holder:
            try:  # a number or a one-element tensor
                n = float(holder["step"]) if not isinstance(holder["step"], str) else -1.0
            except (TypeError, ValueError, RuntimeError):
                return None
            return int(n) if n.is_integer() and 0 <= n <= MAX_STEP else None
    return None


def _replace(module, name: str, orig, wrapper, exporters: tuple[str, ...]) -> None:
    """Put ``wrapper`` (marked with its ``orig``) where ``module.name`` was, and in each package
    of ``exporters`` that bound ``orig`` already (imported before ``install()``)."""
    wrapper._syncwatch_original = orig
    setattr(module, name, wrapper)
    for exporter in filter(None, map(sys.modules.get, exporters)):
        if getattr(exporter, name, None) is orig:
            setattr(exporter, name, wrapper)


def nobody() -> None:
    """A weak reference to nothing: what ``_Steps`` holds before it takes an optimizer or a model
    (calling it gives None, as a dead weak reference does)."""
    return None


class _Steps:
    """Phase switching driven by DDP's patched forward and optimizer hooks (one per process)."""

    def __init__(self, monitor, grad_enabled):
        self.m = monitor
        self.grad_enabled = grad_enabled  # torch.is_grad_enabled
        self.cur = None
        self.backward = monitor.phase("backward")
        monitor.mark_backward_ends()  # the hook-free path marks where a no_sync() backward ends
        # weak references: once the script drops them (a sweep, a cross-validation, a retry in
        # the same process), the next optimizer to step and model to run take over; held by
        # id, the new run's steps never ended and its samples were never counted
        self.optimizer = nobody  # the optimizer whose steps end the steps: the first to step
        self.model = nobody  # the model whose forwards count the samples: the first to run
        self.in_eval = False  # the forward under way runs with autograd off
        # within the step() of the optimizer that ends the steps, and whether a forward there
        # counted its batch: a closure (LBFGS) evaluates the same batch several times
        self.in_step = self.step_counted = False
        self.samples = 0
        self.steps = 0  # steps ended; the first one starts at the first forward, not here:
        # between the model's wrapping and the loop come its setup and often a checkpoint load
        self.thread = threading.get_ident()  # the training thread: the one that wraps the model
        self.hooks: list = []  # the optimizer step hooks' handles

    def switch(self, name: str | None) -> None:
        if self.cur is not None:
            self.cur.__exit__(None, None, None)
            self.cur = None
        if name is not None:
            self.cur = self.m.phase(name)
            self.cur.__enter__()

    def forward_pre(self, model, args, kwargs):
        if self.m is None or _state.monitor is not self.m:
            return
        try:
            self.in_eval = not self.grad_enabled()
            if self.in_eval:  # no training samples: an evaluation, or a frozen teacher
                name = "other" if model.training else "eval"
                if self.cur is not self.m.phase(name):  # one phase for all of its batches
                    self.switch(name)
                return
            if self.model() is None:
                self.model = weakref.ref(model)
            if self.model() is model and not (self.in_step and self.step_counted):
                # a second model (a GAN's other half) sees the same samples again, as does a
                # closure's every evaluation after its first (LBFGS: max_iter of them a step)
                self.samples += batch_size(args, kwargs)
                self.step_counted = self.in_step
            if self.cur is self.backward and not self.in_step:
                # a forward with no optimizer step since the last one: with gradient
                # accumulation, the next micro-batch, loaded since the backward ended; the
                # records thread knows where that was, this thread does not (LBFGS's update
                # between its closure's evaluations, in_step, stays backward)
                self.cur = None
                self.m.next_micro_batch()
            self.switch("forward")
        except Exception:
            self.error()

    def forward_post(self):
        if self.m is not None and _state.monitor is self.m and not self.in_eval:
            self.switch("backward")

    def optimizer_pre(self, optimizer, args, kwargs):
        if self.m is None or _state.monitor is not self.m:
            return
        if self.optimizer() is None:
            self.optimizer = weakref.ref(optimizer)
        if self.optimizer() is optimizer:
            self.in_step, self.step_counted = True, False
            self.switch("optimizer")
        elif not self.in_step and self.cur is not None:
            # another optimizer's own step (a GAN's second half stepping after the first, a
            # second parameter group's optimizer), not one inside the first's step (an optimizer
            # wrapping another: ZeroRedundancyOptimizer): its update is ``optimizer`` too
            self.switch("optimizer")

    def optimizer_post(self, optimizer, args, kwargs):
        if self.m is None or _state.monitor is not self.m:
            return
        if self.optimizer() is not optimizer:
            # and what follows it until the next forward (zero_grad, loading) is ``data``, as
            # after the first's: left in ``backward``, a GAN stepping its discriminator first
            # read its generator's update and the next batch's loading as backward
            if not self.in_step and self.cur is self.m.phase("optimizer"):
                self.switch("data")
            return
        self.in_step = False
        self.end_step()

    def scaler_skipped(self, optimizer):
        """A ``GradScaler.step(optimizer)`` that skipped the optimizer's ``step()`` (inf or NaN
        gradients): the iteration still ends, as if it had stepped."""
        if self.m is None or _state.monitor is not self.m:
            return
        if self.optimizer() is None:
            self.optimizer = weakref.ref(optimizer)
        if self.optimizer() is optimizer:
            self.end_step()

    def error(self) -> None:
        """Count an internal error with the monitor, where there still is one."""
        m = self.m
        if m is not None:
            m._error()

    def stop(self) -> None:
        """Stop driving the phases: the current one ends, the optimizer hooks go, and every
        other hook finds ``m`` None and does nothing (checked before the current monitor: once
        the script's own monitor is shut down too, both are None, and a forward after that went
        on into ``None.phase``). The monitor marks no more backward ends (a script that calls
        ``init()`` itself goes on with it)."""
        self.switch(None)
        for handle in self.hooks:
            handle.remove()
        if self.m is not None:  # stopped once already: a second init() of the script's
            self.m.backward_ended = None
        self.m = None

    def save_begin(self):
        """The phase a save interrupts, after switching to ``checkpoint``; None where the save is
        not timed apart: no loop under way (``cur`` None: before the first forward), another
        thread (an asynchronous checkpointer's), or a save within a save (DCP's writer calls
        ``torch.save`` per item: each one ended and began the checkpoint again, and counted one,
        3 for one ``dcp.save`` on one rank and 7 on the other)."""
        if (self.m is None or _state.monitor is not self.m or self.cur is None
                or threading.get_ident() != self.thread):
            return None
        interrupted = self.cur
        if interrupted is self.m.phase("checkpoint"):
            return None
        self.switch("checkpoint")
        return interrupted

    def save_end(self, interrupted):
        """Back to the ``interrupted`` phase, unless the save switched the phase itself (ran a
        forward)."""
        if (self.m is not None and _state.monitor is self.m
                and self.cur is self.m.phase("checkpoint")):
            self.cur.__exit__(None, None, None)
            self.cur = interrupted
            interrupted.__enter__()

    def end_step(self):
        self.switch(None)
        number = None
        if _loaded:  # a checkpoint loaded since the last step: its step count goes on
            optimizer = self.optimizer()
            number = _loaded.get(optimizer) if optimizer is not None else None
            _loaded.clear()
            if number is not None:
                number += 1
        self.m.step(self.samples, None, number)
        self.samples = 0
        self.steps += 1
        self.switch("data")


def batch_size(args, kwargs) -> int:
    """The batch dimension of the first tensor given to forward: ``model(x)``, then
    ``model(input_ids=x)`` (HuggingFace's ``model(**batch)``), then a tensor in a dict, list or
    tuple given whole (``model(batch)``); 0 where there is none."""
    for a in args:
        if getattr(a, "ndim", 0):
            return int(a.shape[0])
    values = kwargs.values()
    for a in values:
        if getattr(a, "ndim", 0):
            return int(a.shape[0])
    for a in (*args, *values):
        inner = a.values() if isinstance(a, dict) else a if isinstance(a, (list, tuple)) else ()
        for b in inner:
            if getattr(b, "ndim", 0):
                return int(b.shape[0])
    return 0


def _patch_grad_scaler_module(module) -> None:
    """Wrap ``GradScaler.step``, once: a step it skips (inf or NaN gradients, frequent while an
    fp16 job calibrates its loss scale) calls no optimizer ``step()``, and would otherwise merge
    that iteration into the next step."""
    cls = module.GradScaler
    if getattr(cls, "_syncwatch_patched", False):
        return
    orig = cls.step

    @functools.wraps(orig)
    def step(self, optimizer, *args, **kwargs):
        steps = _steps
        if steps is None:
            return orig(self, optimizer, *args, **kwargs)
        before = steps.steps
        out = orig(self, optimizer, *args, **kwargs)
        if steps.steps == before:
            try:
                steps.scaler_skipped(optimizer)
            except Exception:
                steps.error()
        return out

    cls.step = step
    cls._syncwatch_patched = True


def _patch_saver(module, name: str, exporters: tuple[str, ...]) -> None:
    """Wrap ``module.name``, a checkpoint saver, once: each call on the training thread is timed
    as ``checkpoint`` (``_Steps.save_begin``). The packages in ``exporters`` that bound the
    original already (imported before ``install()``) are rebound to the wrapper."""
    orig = getattr(module, name)
    if getattr(orig, "_syncwatch_original", None) is not None:
        return

    @functools.wraps(orig)
    def save(*args, **kwargs):
        steps = _steps
        interrupted = None
        if steps is not None:
            try:
                interrupted = steps.save_begin()
            except Exception:
                steps.error()
        if interrupted is None:
            return orig(*args, **kwargs)
        try:
            return orig(*args, **kwargs)
        finally:
            try:
                steps.save_end(interrupted)
            except Exception:
                steps.error()

    _replace(module, name, orig, save, exporters)


def _patch_torch_save_module(module) -> None:
    _patch_saver(module, "save", ("torch",))


def _patch_dcp_module(module) -> None:
    for name in ("save", "async_save"):
        _patch_saver(module, name, ("torch.distributed.checkpoint",))


def _patch_safetensors_module(module) -> None:
    """Hugging Face's ``Trainer`` and ``save_pretrained`` save with these by default: unmarked, a
    minutes-long save read as ``data``, jitter that held the step CV high as no checkpoint does.
    ``save_model`` calls ``save_file``: one save."""
    for name in ("save_file", "save_model"):
        _patch_saver(module, name, ())


_steps: _Steps | None = None
_stood_down = False  # the script instruments itself: zero-code mode does nothing more
ATTACHED = "_syncwatch_steps"  # a model's attribute: the _Steps its forward drives
_fsdp_undo: list = []  # takes the phases back from the FSDP model that drives them
# optimizer -> the step count of the state it loaded since the last step (``loaded_step``)
_loaded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _group_size(group) -> int:
    """The number of ranks in a process group (None: the default group's)."""
    import torch.distributed as dist
    return dist.get_world_size(group)


def _spans_world(size: int) -> bool:
    """Whether a model sharded or replicated over ``size`` ranks spans every rank of the world:
    then every rank builds it, at once (DDP's construction is a collective of its group), and
    the side group of the skew exchange, a collective of the whole world, can be made there."""
    import torch.distributed as dist
    return size == dist.get_world_size()


def _start(whole_world: bool):
    """The process's ``_Steps``, started with the monitor at the first model; None where
    ``init()`` stays a no-op, or where the script instruments itself (``stand_down``). A first
    model over a part of the world starts the monitor without the skew exchange: making its
    side group needs every rank of the world, and ranks outside that model's group may never
    build one (they waited forever in the script's next collective, and rank 0 in making the
    group)."""
    global _steps
    import syncwatch.instrument as sw
    import torch
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    if _stood_down:
        return None
    if _state.monitor is None:
        if whole_world:
            monitor = sw.init()
        else:
            log.warning("syncwatch: the first model's process group is a part of the world: "
                        "zero-code mode runs without the skew exchange (exact slack, last "
                        "arrivals and skew need every rank; syncwatch.instrument.init() on "
                        "every rank gives them)")
            monitor = sw.init(exchange_every=0)
        if monitor is None:
            return None
    elif _steps is not None and _steps.m is _state.monitor:
        monitor = _state.monitor
    else:  # the script called init() before building its model: it drives the monitor
        stand_down()
        return None
    if _steps is None or _steps.m is not monitor:
        if _steps is not None:  # the monitor it drove was shut down: its optimizer hooks go
            _steps.stop()
        _steps = _Steps(monitor, torch.is_grad_enabled)
        sw.register(collectives=True)
        _steps.hooks = [register_optimizer_step_pre_hook(_steps.optimizer_pre),
                        register_optimizer_step_post_hook(_steps.optimizer_post)]
    return _steps


def drives(monitor) -> bool:
    """Whether zero-code mode started ``monitor`` and drives its steps."""
    return _steps is not None and _steps.m is monitor


def stand_down() -> None:
    """The script instruments itself (``syncwatch.instrument.init()`` of its own, before or
    after building its model): zero-code mode stops for the rest of the process, so that each
    step is the script's alone. Beside the script's, its optimizer hooks ended a second step at
    every ``step()``, the samples counted twice, and the script's own step numbers, going back
    to its count each time, read as a restart every step. What it attached stays: the gradient
    wait and the collective wrappers, which the script's ``register()`` would attach the same."""
    global _stood_down
    _stood_down = True
    if _steps is not None:
        _steps.stop()


def _attach(ddp) -> None:
    import syncwatch.instrument as sw
    steps = _start(_spans_world(_group_size(getattr(ddp, "process_group", None))))
    if steps is None:
        return
    sw.register(ddp, collectives=False)
    ddp.__dict__[ATTACHED] = steps


def _attach_fsdp(model, whole_world: bool | None = None) -> None:
    """FSDP wraps bottom-up, the root last: each new FSDP model takes over the phases from the
    one before, so the root's forward drives them in the end (nested FSDP units, and modules
    that activation checkpointing runs again in backward, switch nothing). Its collectives are
    the wrapped ones: nothing else is attached. ``FullyShardedDataParallel`` has a patched
    ``forward``; a ``fully_shard`` module, whose class is made per module type, gets forward
    hooks (FSDP's own hooks have taken it off the fast call path already)."""
    from torch import nn
    if whole_world is None:  # FullyShardedDataParallel: sharded within its group, replicated
        # across its inter-node one where it has one (HYBRID_SHARD)
        inter = getattr(model, "_inter_node_pg", None)
        whole_world = _spans_world(_group_size(getattr(model, "process_group", None))
                                   * (1 if inter is None else _group_size(inter)))
    steps = _start(whole_world)
    if steps is None or not isinstance(model, nn.Module):
        return
    while _fsdp_undo:
        _fsdp_undo.pop()()
    if getattr(type(model), "_syncwatch_patched", False):  # FullyShardedDataParallel
        model.__dict__[ATTACHED] = steps
        # held weakly, as the hooks' handles hold a fully_shard module: a model the script drops
        # is freed then, not when the next one is built, with the one after it in memory already
        ref = weakref.ref(model)
        _fsdp_undo.append(lambda: getattr(ref(), "__dict__", {}).pop(ATTACHED, None))
        return
    pre = model.register_forward_pre_hook(
        lambda module, args, kwargs: steps.forward_pre(module, args, kwargs),
        prepend=True, with_kwargs=True)  # before FSDP's all-gather
    post = model.register_forward_hook(lambda module, args, out: steps.forward_post(),
                                       always_call=True)
    _fsdp_undo.extend((pre.remove, post.remove))


PATCHES = {  # module -> what patches it once it has executed
    "torch.nn.parallel.distributed": _patch_ddp_module,
    "torch.distributed.fsdp.fully_sharded_data_parallel": _patch_fsdp_module,
    "torch.distributed.fsdp._fully_shard._fully_shard": _patch_fully_shard_module,
    "torch.distributed.fsdp._fully_shard._fsdp_state": _patch_fsdp_state_module,
    "torch.distributed.fsdp._runtime_utils": _patch_fsdp_runtime_module,
    "torch.amp.grad_scaler": _patch_grad_scaler_module,
    "torch.optim.optimizer": _patch_optimizer_module,
    "torch.serialization": _patch_torch_save_module,
    "torch.distributed.checkpoint.state_dict_saver": _patch_dcp_module,
    "safetensors.torch": _patch_safetensors_module,
}
