"""How the gradient wait of a DDP model is measured, and the ``torch.distributed`` wrappers.

Default, hook-free (``watch_gradients``): DDP keeps its built-in C++ all-reduce. A
post-accumulate-grad hook on the model's first parameter that requires grad (or its first and
last few, where DDP allows unused parameters) queues a callback on the autograd engine once per backward. Final callbacks run
in FIFO order after backward's last node: this first callback marks "gradients ready" (all of
the backward's compute is done) and queues a second one. Both are the C notes' (a ``Relay`` and
a ``Mark``: no Python frame, which costs 1-3 us after a backward), except in the first backward
passes, whose first callback also reads DDP's bucket count. DDP queues its ``finalize_backward``
(which waits for every bucket's all-reduce) when its last bucket becomes ready, after our first
callback was queued and before the second one is: so the second callback runs once the
collectives are done, and marks "gradients synchronized". On CUDA both marks are events on the
current stream, which autograd syncs with the gradients' streams before final callbacks and DDP's
finalize makes wait on the all-reduce work.

With a user's comm hook (``ddp_hook_wrapper``), composing like torch's ``fp16_compress_wrapper``:
each bucket is marked at hook entry (its gradients are ready) and in a ``.then`` callback (its
collective is done); the last bucket's difference is the wait (its backward's: a bucket of another
backward, by its autograd graph task, ends it, so two wrapped models in one phase both count).
Any Python comm hook costs an
extra pass over each bucket (DDP's built-in fuses the 1/world scaling into its copy) and Python
on the autograd and communication threads, which the hook-free path avoids.

The collective wrappers replace the ``COLLECTIVES`` in ``torch.distributed`` that the installed
torch has (callers that look them up there: ``dist.all_reduce(...)``; a name bound earlier with
``from torch.distributed import all_reduce`` keeps the original). Each call bumps the collective
sequence; a blocking call is timed as ``sync``, an async one where its work is waited on
(``Work.wait`` is wrapped). FSDP (``FullyShardedDataParallel`` and
``fully_shard``) calls its all-gathers and reduce-scatters this way (``all_gather`` or
``all_gather_single``, ``reduce_scatter_single`` in torch 2.13), so an FSDP model's waits are the
wrapped collectives' and nothing else is attached to it.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref

from . import _state
from .monitor import READY

# wrapped where the installed torch has them; the ``*_single`` names are torch 2.13's (FSDP's);
# each one's ``async_op`` position is read from its signature
COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all",
               "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier")
WATCHED_PARAMETERS = 8  # hooked, where DDP allows unused parameters, so that at least one of
# them gets a gradient in every backward (half the first, half the last: a backbone frozen after
# wrapping leaves the head's); otherwise every parameter gets one and 1 is enough
BUCKET_COUNT_READS = 3  # DDP rebuilds its buckets once, after its first iteration


class Refused(TypeError):
    """A model ``register()`` does not take as given: the script's mistake, told in one line."""


class Handle:
    """What a registration attached; ``remove()`` detaches all of it (idempotent).

    The hook-free path's hooks and the collective wrappers are truly removed. DDP cannot
    unregister a comm hook, so a removed ``ddp_hook_wrapper`` stays in place as a pure
    pass-through to the hook it wraps."""

    def __init__(self):
        self._undo: list = []

    def add(self, undo) -> None:
        self._undo.append(undo)

    def remove(self) -> None:
        while self._undo:
            try:
                self._undo.pop()()
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


def watch_gradients(model) -> Handle:
    """Measure the gradient wait of a ``DistributedDataParallel`` model without a comm hook.

    Hooks the first of DDP's parameters (not those it ignores) that requires grad, or the
    first and the last ``WATCHED_PARAMETERS // 2`` where DDP allows unused parameters
    (``find_unused_parameters`` or ``static_graph``): an unused branch, or a backbone frozen
    after wrapping (fine-tuning's first steps, a linear probe), leaves some of them a gradient;
    the first of them to get its gradient in a backward queues the two callbacks (see the
    module docstring). Any one will do: final callbacks run after the whole backward, and a
    parameter's hook runs before DDP's own, so before DDP queues its ``finalize_backward``.
    Without unused parameters every parameter gets a gradient in every backward (DDP raises
    otherwise), and each hook costs a Python call from the autograd engine (~1-3 us), so one
    is enough. Its tensor hook runs before DDP's own hook on the same parameter's gradient
    accumulator, so our first callback is still queued before DDP's ``finalize_backward``. Like
    the wrapper, which counts each bucket's hook, a synchronized backward advances the
    collective sequence by DDP's bucket count (its all-reduces). A backward under
    ``model.no_sync()`` synchronizes nothing and is not measured; where the monitor marks
    backward ends (``Monitor.backward_ended``: zero-code mode, for gradient accumulation's
    loading between micro-batches) the hook queues that mark as its one final callback. A model
    that is already watched is left as it is."""
    import torch
    from torch.autograd import Variable
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise Refused(f"neither a DistributedDataParallel nor an FSDP model: "
                      f"{type(model).__name__}")
    handle = Handle()
    if getattr(model, "_syncwatch_watched", False):
        return handle
    queue = Variable._execution_engine.queue_callback
    task_id = torch._C._current_graph_task_id
    unused_allowed = getattr(model, "find_unused_parameters", True) or getattr(
        model, "static_graph", True)
    watched = WATCHED_PARAMETERS if unused_allowed else 1
    last_task = [None]
    # DDP's bucket count and the times it was read: kept on the model, so that watching it
    # again (after a handle's remove()) does not read DDP's logging data again (~90 us a read)
    buckets = model.__dict__.setdefault("_syncwatch_buckets", [1, 0])
    # this watch's key in the monitor's relays (the first callback once the count is read): the
    # monitor keeps them, so that a model outliving a shut-down monitor does not keep it alive
    token = object()
    # the hooks reach the model through a weak reference: torch keeps a parameter's hooks where
    # the garbage collector cannot see them, so a hook holding its model made a cycle never
    # collected, and every watched model stayed in memory with its parameters and gradients
    ddp = weakref.ref(model)

    def gradients_ready():
        """The first callback while DDP's bucket count is still read."""
        m = _state.monitor
        if m is None:
            return
        try:
            queue(m.grads_synced)  # runs after DDP's finalize_backward, queued meanwhile
            buckets[0], buckets[1] = _bucket_count(ddp()), buckets[1] + 1
            m._put((READY, m._mark(), buckets[0]))  # m.bucket_ready inlined: a frame less
        except Exception:
            m._error()

    def gradient_accumulated(param):
        m, model = _state.monitor, ddp()
        if m is None or model is None:
            return  # model None: the DDP is gone, its module trained on (wrapped anew, or alone)
        synced = model.require_backward_grad_sync
        if not synced and m.backward_ended is None:
            return  # no_sync(): nothing to measure, nor (the explicit API's) to mark
        try:
            if watched > 1:  # with one watched parameter, this runs once per backward
                task = task_id()
                if task == last_task[0]:
                    return
                last_task[0] = task
            if not synced:  # no_sync(): no wait; its end is marked (zero-code mode)
                queue(m.backward_ended)
                return
            if buckets[1] < BUCKET_COUNT_READS:
                queue(gradients_ready)
                return
            relay = m.relays.get(token)
            if relay is None:
                relay = m.relays[token] = m._notes.relay(
                    READY, buckets[0], functools.partial(queue, m.grads_synced))
            queue(relay)
        except Exception:
            m._error()

    # DDP's own parameters: not those it was told to ignore (another parallelism's, such as MoE
    # experts; delay_all_reduce_named_params). An ignored first layer's gradient comes after DDP
    # queued its finalize, so both callbacks ran after the wait and measured none
    managed = getattr(model, "_module_parameters", None) or list(model.parameters())
    params = [p for p in managed if p.requires_grad]
    if len(params) > watched:
        last = watched // 2  # none where one is watched
        params = params[:watched - last] + params[len(params) - last:]
    for p in params:
        handle.add(p.register_post_accumulate_grad_hook(gradient_accumulated).remove)
    model._syncwatch_watched = True
    handle.add(lambda: setattr(model, "_syncwatch_watched", False))
    handle.add(lambda: _state.monitor is not None and _state.monitor.relays.pop(token, None))
    return handle


def _bucket_count(model) -> int:
    """The number of all-reduces DDP launches per backward (its buckets), from its logging data."""
    try:
        data = model._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        return sizes.count(",") + 1
    except Exception:
        return 1


def ddp_hook_wrapper(hook, _enabled=None):
    """Return a DDP comm hook that runs ``hook`` and measures the gradient wait."""
    import torch
    enabled = _enabled if _enabled is not None else [True]
    backward = torch._C._current_graph_task_id  # which backward a bucket belongs to

    def syncwatch_wrapper_hook(state, bucket):
        m = _state.monitor
        if m is None or not enabled[0]:
            return hook(state, bucket)
        m.bucket_ready(1, backward())
        _state.in_ddp_hook += 1
        try:
            fut = hook(state, bucket)
        finally:
            _state.in_ddp_hook -= 1
        return fut.then(m.bucket_done_then)

    syncwatch_wrapper_hook._syncwatch_wrapper = True
    syncwatch_wrapper_hook.__qualname__ = f"syncwatch_wrapper_hook({getattr(hook, '__qualname__', hook)})"
    return syncwatch_wrapper_hook


def is_fsdp(model) -> bool:
    """Whether ``model`` is FSDP's: a ``FullyShardedDataParallel`` or a module that
    ``fully_shard`` was applied to."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = tuple(k for k in (getattr(fsdp, "FullyShardedDataParallel", None),
                              getattr(fsdp, "FSDPModule", None)) if isinstance(k, type))
    return bool(kinds) and isinstance(model, kinds)


def register_model(model, hook=None, state=None) -> Handle:
    """Measure ``model``'s gradient wait. DDP: hook-free, or with ``hook`` through the wrapper.
    FSDP: nothing to attach, its collectives are the wrapped ones (``patch_collectives``).
    A ``torch.compile``d model (``torch.compile(DDP(model))``, as torch recommends) is the
    module it compiled: its parameters, gradients and DDP reducer are that module's."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    if is_fsdp(model):
        if hook is not None:
            raise Refused("ddp_hook_wrapper wraps DDP comm hooks, not FSDP's: register an FSDP "
                          "model without hook=")
        return Handle()
    if hook is None:
        return watch_gradients(model)
    handle = Handle()
    enabled = [True]
    model.register_comm_hook(state, ddp_hook_wrapper(hook, enabled))
    handle.add(lambda: enabled.__setitem__(0, False))
    return handle


def backward_probe():
    """A function saying whether the calling thread runs a backward: autograd's own thread for
    CUDA tensors, whose collectives (FSDP's reduce-scatters) are the training step's. Asked at
    every such collective, so torch's function is looked up once, here."""
    import torch
    task_id = torch._C._current_graph_task_id
    return lambda: task_id() != -1


def original(name: str):
    """torch.distributed's own function ``name``, unwrapped."""
    import torch.distributed as dist
    fn = getattr(dist, name)
    return getattr(fn, "_syncwatch_original", fn)


def _async_position(fn) -> int:
    """The position of ``fn``'s ``async_op`` parameter (torch's logging decorators keep the
    signature). Raises ``ValueError`` for a function without one."""
    return list(inspect.signature(fn).parameters).index("async_op")


def _wrap(orig, async_index: int):
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        m = _state.monitor
        if m is None or _state.in_ddp_hook:
            return orig(*args, **kwargs)
        return m.timed_collective(orig, args, kwargs, async_index)
    wrapper._syncwatch_original = orig
    return wrapper


def patch_collectives() -> Handle:
    """Wrap the collectives in ``torch.distributed``, and ``Work.wait`` (the wait on an async
    one's work); the handle restores the originals."""
    import torch.distributed as dist
    handle = Handle()
    handle.add(_patch_work_wait(dist))
    for name in COLLECTIVES:
        orig = getattr(dist, name, None)
        if orig is None or hasattr(orig, "_syncwatch_original"):
            continue
        try:
            wrapper = _wrap(orig, _async_position(orig))
        except (TypeError, ValueError):  # a torch whose version of it has no async_op
            continue
        setattr(dist, name, wrapper)

        def undo(name=name, orig=orig, wrapper=wrapper):
            if getattr(dist, name) is wrapper:
                setattr(dist, name, orig)
        handle.add(undo)
    return handle


def _patch_work_wait(dist):
    """Wrap ``dist.Work.wait``, once; returns what restores it."""
    work = getattr(dist, "Work", None)
    wait = getattr(work, "wait", None)
    if wait is None or hasattr(wait, "_syncwatch_original"):
        return lambda: None

    @functools.wraps(wait)
    def timed_wait(self, *args, **kwargs):
        m = _state.monitor
        if m is None or _state.in_ddp_hook:
            return wait(self, *args, **kwargs)
        return m.timed_wait(wait, self, args, kwargs)
    timed_wait._syncwatch_original = wait
    work.wait = timed_wait

    def undo():
        if work.wait is timed_wait:
            work.wait = wait
    return undo
