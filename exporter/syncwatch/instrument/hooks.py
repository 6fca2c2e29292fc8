"""DDP communication-hook wrapper and ``torch.distributed`` collective wrappers.

The DDP wrapper composes like torch's ``fp16_compress_wrapper``: it wraps any hook (default
``mean_allreduce_hook``: exactly DDP's built-in arithmetic, multiply by 1/world then sum) and adds
two timestamps per bucket, one at hook entry (the bucket's gradients are ready) and one in a
``.then`` callback (its collective is done). The last bucket's difference is the step's gradient
wait: the time from the end of backward compute until the gradients are synchronized.

The collective wrappers replace ``all_reduce``, ``reduce_scatter``, ``reduce_scatter_tensor``,
``all_gather``, ``all_gather_into_tensor``, ``broadcast`` and ``barrier`` in ``torch.distributed``
(callers that look them up there: ``dist.all_reduce(...)``; a name bound earlier with
``from torch.distributed import all_reduce`` keeps the original). Each call bumps the collective
sequence; a blocking call is timed as ``sync``.
"""

from __future__ import annotations

import functools

from . import _state

# collective -> position of its ``async_op`` parameter
COLLECTIVES = {"all_reduce": 3, "reduce_scatter": 4, "reduce_scatter_tensor": 4, "all_gather": 3,
               "all_gather_into_tensor": 3, "broadcast": 3, "barrier": 1}


class Handle:
    """What a registration attached; ``remove()`` detaches all of it (idempotent).

    DDP cannot unregister a comm hook, so a removed DDP wrapper stays in place as a pure
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


def mean_allreduce_hook(process_group, bucket):
    """DDP's built-in all-reduce as a hook, with its exact arithmetic.

    The built-in multiplies each gradient by ``1/world`` while copying it into the bucket, then
    sums. torch's Python ``allreduce_hook`` *divides* by the world size, which differs in the last
    bit when the world size is not a power of two; this hook multiplies, so results stay equal.
    Any comm hook costs one extra pass over the bucket (the built-in fuses it into the copy)."""
    import torch.distributed as dist
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.mul_(1.0 / dist.get_world_size(group))
    return original("all_reduce")(tensor, group=group, async_op=True).get_future()


def ddp_hook_wrapper(hook=None, _enabled=None):
    """Return a DDP comm hook that runs ``hook`` (default ``mean_allreduce_hook``) and measures
    the gradient wait."""
    # the default hook's future holds [tensor]; our callback unwraps it
    first = hook is None or hook is mean_allreduce_hook
    if hook is None:
        hook = mean_allreduce_hook
    enabled = _enabled if _enabled is not None else [True]

    def syncwatch_wrapper_hook(state, bucket):
        m = _state.monitor
        if m is None or not enabled[0]:
            fut = hook(state, bucket)
            return fut.then(_first) if first else fut
        m.bucket_ready()
        _state.in_ddp_hook += 1
        try:
            fut = hook(state, bucket)
        finally:
            _state.in_ddp_hook -= 1
        return fut.then(m.bucket_done_first if first else m.bucket_done_then)

    syncwatch_wrapper_hook._syncwatch_wrapper = True
    syncwatch_wrapper_hook.__qualname__ = f"syncwatch_wrapper_hook({getattr(hook, '__qualname__', hook)})"
    return syncwatch_wrapper_hook


def _first(fut):
    return fut.value()[0]


def register_ddp(model, hook=None, state=None) -> Handle:
    """Register ``ddp_hook_wrapper(hook)`` on a ``DistributedDataParallel`` model."""
    handle = Handle()
    enabled = [True]
    if state is None and hook is None:
        state = getattr(model, "process_group", None)  # the group DDP reduces over
    model.register_comm_hook(state, ddp_hook_wrapper(hook, enabled))
    handle.add(lambda: enabled.__setitem__(0, False))
    return handle


def original(name: str):
    """torch.distributed's own function ``name``, unwrapped."""
    import torch.distributed as dist
    fn = getattr(dist, name)
    return getattr(fn, "_syncwatch_original", fn)


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
    """Wrap the collectives in ``torch.distributed``; the handle restores the originals."""
    import torch.distributed as dist
    handle = Handle()
    for name, async_index in COLLECTIVES.items():
        orig = getattr(dist, name, None)
        if orig is None or hasattr(orig, "_syncwatch_original"):
            continue
        wrapper = _wrap(orig, async_index)
        setattr(dist, name, wrapper)

        def undo(name=name, orig=orig, wrapper=wrapper):
            if getattr(dist, name) is wrapper:
                setattr(dist, name, orig)
        handle.add(undo)
    return handle
