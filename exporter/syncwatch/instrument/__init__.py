"""PyTorch instrumentation that runs inside every training rank.

    import syncwatch.instrument as sw

    dist.init_process_group("gloo")           # or nccl
    model = DDP(model)
    sw.init()                                 # identity from torch.distributed + launcher env
    handle = sw.register(model)               # DDP gradient wait + collective wrappers
    for batch in loader:
        with sw.phase("data"): ...
        with sw.phase("forward"): ...
        with sw.phase("backward"): loss.backward()
        with sw.phase("optimizer"): opt.step()
        sw.step(samples=len(batch))
    sw.shutdown()

Everything is a no-op until ``init()`` succeeded, and ``init()`` does nothing where
``torch.distributed`` is not initialized. Importing this package does not import torch or
prometheus_client. See docs/instrumentation.md.
"""

from __future__ import annotations

import atexit
import logging
import math
import operator
import os
import sys
import threading

from ..protocol import MAX_ATTEMPT
from ..skew import EXCHANGE_SECONDS
from . import _state
from .hooks import Handle, ddp_hook_wrapper
from .monitor import Monitor

__all__ = ["init", "phase", "step", "shutdown", "register", "ddp_hook_wrapper", "Handle",
           "Monitor", "current"]

log = logging.getLogger("syncwatch.instrument")

DEFAULT_EXCHANGE_EVERY = 50
DEFAULT_HEARTBEAT_SECONDS = 5.0
DEVICES = ("cpu", "cuda")


phase = _state.phases.__getitem__
"""``phase(name)``: the context manager timing phase ``name``: data, forward, backward, optimizer,
checkpoint, eval (any other name: ``other``). A dict lookup in C (see ``_state.Phases``).
``checkpoint`` and ``eval`` are planned pauses: left out of the step-time variance, and a rank in
one for less than 30 minutes does not make its job read stalled."""
_end_reason: str | None = None  # set by the process' way out; None: completed


def current() -> Monitor | None:
    return _state.monitor


step = _state.notes.step
"""``step(samples=0, tokens=None, step=None)``: end a step that processed ``samples`` (and
``tokens``); ``step`` = the job's own step number (default: the previous one + 1)."""


# what an exchange_every / exchange_seconds is, given or in the environment: (valid, expected)
_STEPS_OK = (lambda k: k >= 0, "0 (off) or a number of steps")
_SECONDS_OK = (lambda s: s >= 0, "0, a positive number or inf")


def _checked(name: str, shown, value, default, valid, expected: str):
    """``value`` where ``valid`` takes it; else ``default``, with a warning that names ``name``.
    An out-of-range value was taken as it came: a heartbeat of -1 or ``nan`` sent none, a
    negative K turned the exchange off, without a word."""
    if value is not None and valid(value):
        return value
    log.warning("syncwatch: ignoring %s=%r (expected %s): using %g", name, shown, expected, default)
    return default


def _env_number(name: str, conv, default, valid, expected: str):
    """``$name`` as ``conv`` gives it, checked as ``_checked`` does; ``default`` where unset."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = conv(raw)
    except ValueError:
        value = None
    return _checked(name, raw, value, default, valid, expected)


def _arg_number(name: str, value, conv, default, valid, expected: str):
    """``init()``'s argument ``name`` as ``conv`` gives it, checked as ``_checked`` does (the
    variable not consulted in its place). A string (``heartbeat_seconds="5"``) is refused: taken
    as it came, it stopped the records thread, and no record was sent at all."""
    try:
        x = None if isinstance(value, (bool, str, bytes)) else conv(value)
    except (TypeError, ValueError, OverflowError):
        x = None
    return _checked(name, value, x, default, valid, expected)


def init(*, job: str | None = None, attempt: int | None = None, node: str | None = None,
         exchange_every: int | None = None, exchange_seconds: float | None = None,
         heartbeat_seconds: float | None = None, socket: str | None = None,
         udp: str | None = None, device: str | None = None, sender=None,
         clock=None) -> Monitor | None:
    """Start instrumenting this rank; returns the Monitor, or None where it stays a no-op.

    Call it on every rank after ``init_process_group`` (it creates the side gloo group of the
    skew exchange, a collective call). ``exchange_every``: K (default ``$SYNCWATCH_SKEW_EVERY``
    or 50; 0 = off). ``exchange_seconds``: where K steps take longer, the windows after the
    first are as many steps as take this long (default ``$SYNCWATCH_SKEW_SECONDS`` or 30; 0 =
    always K). ``heartbeat_seconds``: default ``$SYNCWATCH_HEARTBEAT`` or 5; 0 = off. A value
    out of those bounds (a negative or NaN number, a string) is ignored with a warning, and the
    default taken. ``device``: "cpu" (monotonic clock) or "cuda" (CUDA events); default: cuda
    when the default group's backend is NCCL (another value is ignored, with a warning). Never
    raises.
    """
    if _state.monitor is not None:  # zero-code mode started it, or the script's own init()
        auto = sys.modules.get("syncwatch.instrument.auto")
        zero_code = auto is not None and auto.drives(_state.monitor)
        if auto is not None:  # the script takes over
            auto.stand_down()
        given = [name for name, value in (
            ("job", job), ("attempt", attempt), ("node", node), ("exchange_every", exchange_every),
            ("exchange_seconds", exchange_seconds), ("heartbeat_seconds", heartbeat_seconds),
            ("socket", socket), ("udp", udp), ("device", device), ("sender", sender),
            ("clock", clock)) if value is not None]
        if given and zero_code:
            log.warning("syncwatch: init() came after instrumentation started (syncwatch-run "
                        "starts it at the first model): it goes on as started, and ignores %s; "
                        "call init() before building the model, or give them to syncwatch-run "
                        "(its options, or SYNCWATCH_* variables)", ", ".join(given))
        elif given:
            log.warning("syncwatch: init() called again while the instrumentation runs: it "
                        "goes on as started, and ignores %s; call shutdown() first to "
                        "start anew", ", ".join(given))
        return _state.monitor
    try:
        return _init(job, attempt, node, exchange_every, exchange_seconds, heartbeat_seconds,
                     socket, udp, device, sender, clock)
    except Exception:
        log.warning("syncwatch: instrumentation not started", exc_info=True)
        return None


def _init(job, attempt, node, exchange_every, exchange_seconds, heartbeat_seconds, socket, udp,
          device, sender, clock):
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if os.environ.get("WORLD_SIZE"):  # a launcher started a rank: init() came too early
            log.warning("syncwatch: init() before torch.distributed.init_process_group(): "
                        "instrumentation not started; call init() after it")
        return None
    from . import hooks, identity
    from ..sender import Sender
    from .clock import CudaEventClock, HostClock
    from .exchange import SkewExchange

    rank, world = dist.get_rank(), dist.get_world_size()
    if job is None and identity.job_from_env() is None:
        job = _shared_generated_job(dist)
    asked = f"device={device!r}"
    if device is None and os.environ.get("SYNCWATCH_DEVICE"):
        device = os.environ["SYNCWATCH_DEVICE"]
        asked = f"SYNCWATCH_DEVICE={device!r}"
    if device is not None and device not in DEVICES:  # 'gpu' read as cpu, without a word
        log.warning("syncwatch: ignoring %s (expected cpu or cuda)", asked)
        device = None
    if device == "cuda" and not torch.cuda.is_available():  # it raised: not started at all
        log.warning("syncwatch: ignoring %s (CUDA is not available here): timing on the CPU "
                    "clock", asked)
        device = "cpu"
    device = device or (
        "cuda" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "cpu")
    gpu, uuid = -1, ""
    if device == "cuda":
        current = torch.cuda.current_device()
        gpu = identity.rank_gpu(current, torch.cuda.device_count())
        if gpu != current:
            log.warning("syncwatch: the current CUDA device is %d on local rank %d: timing on "
                        "GPU %d, the local rank's (torch.cuda.set_device(%d) before init() says "
                        "so)", current, gpu, gpu, gpu)
        uuid = identity.cuda_uuid(gpu)
    if attempt is not None:  # one beyond the protocol's bound, or -1, "3": not started at all
        attempt = min(_arg_number("attempt", attempt, operator.index, identity.attempt_from_env(),
                                  lambda n: n >= 0, "a whole number from 0"), MAX_ATTEMPT - 1)
    ident = identity.resolve(rank=rank, world_size=world, job=job, attempt=attempt, node=node,
                             gpu=gpu, gpu_uuid=uuid)
    if clock is None:
        clock = CudaEventClock(device=gpu) if device == "cuda" else HostClock()
    if exchange_every is not None:
        exchange_every = _arg_number("exchange_every", exchange_every, operator.index,
                                     DEFAULT_EXCHANGE_EVERY, *_STEPS_OK)
    if exchange_seconds is not None:
        exchange_seconds = _arg_number("exchange_seconds", exchange_seconds, float,
                                       EXCHANGE_SECONDS, *_SECONDS_OK)
    if heartbeat_seconds is not None:
        heartbeat_seconds = _arg_number("heartbeat_seconds", heartbeat_seconds, float,
                                        DEFAULT_HEARTBEAT_SECONDS,
                                        lambda s: s == 0 or 0 < s < math.inf,
                                        "0 (off) or a positive number of seconds")
    if exchange_every is None:
        exchange_every = _env_number("SYNCWATCH_SKEW_EVERY", int, DEFAULT_EXCHANGE_EVERY,
                                     *_STEPS_OK)
    if exchange_seconds is None:
        exchange_seconds = _env_number("SYNCWATCH_SKEW_SECONDS", float, EXCHANGE_SECONDS,
                                       *_SECONDS_OK)
    if heartbeat_seconds is None:
        heartbeat_seconds = _env_number("SYNCWATCH_HEARTBEAT", float, DEFAULT_HEARTBEAT_SECONDS,
                                        lambda s: 0 < s < math.inf,
                                        "a positive number of seconds")
    exchange = None
    if exchange_every > 0 and world > 1:
        group = dist.new_group(backend="gloo")
        exchange = SkewExchange(group, hooks.original("all_reduce"), dist.ReduceOp.MIN,
                                dist.ReduceOp.MAX,
                                lambda waits: torch.tensor(waits, dtype=torch.float64))
    if socket is not None and udp is None:
        # given, it wins over an inherited SYNCWATCH_UDP, which the sender takes first ("": none)
        udp = ""
    monitor = Monitor(ident, sender or Sender(path=socket, udp=udp), clock=clock,
                      exchange=exchange, exchange_every=exchange_every,
                      exchange_seconds=exchange_seconds, heartbeat_seconds=heartbeat_seconds,
                      in_backward=hooks.backward_probe())
    _state.set_monitor(monitor)
    _guard_destroy(dist)
    atexit.register(_at_exit)
    _hook_exits()
    return monitor


def _shared_generated_job(dist) -> str | None:
    """No job name in the environment: the first rank to get here generates one, and every
    rank takes it from the store (a compare-and-set: nobody waits for anybody. Rank 0 set it
    and the others waited up to 30 s for it, on the training thread, where rank 0 came late or
    never: a model that only some ranks build under ``syncwatch-run``)."""
    from .identity import generated_job
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set("syncwatch/job", "", generated_job()).decode()
    except Exception:
        return None  # identity.resolve generates a per-rank one


def _guard_destroy(dist) -> None:
    """Shut down before the process groups go: the exchange thread uses the side group."""
    orig = dist.destroy_process_group
    if hasattr(orig, "_syncwatch_original"):
        return

    def destroy_process_group(*args, **kwargs):
        group = args[0] if args else kwargs.get("group")
        if group is None or group is dist.group.WORLD:  # all of them, the side group too
            shutdown()
        return orig(*args, **kwargs)
    destroy_process_group._syncwatch_original = orig
    dist.destroy_process_group = destroy_process_group


def _hook_exits() -> None:
    """Learn how the process ends, for its end record: an uncaught exception ``failed`` (a
    KeyboardInterrupt ``interrupted``), and ``sys.exit`` with a failure status on the main
    thread ``failed``, which atexit cannot tell from a clean end (a script giving up on a NaN
    loss with ``sys.exit(1)`` ended ``completed``, and SyncwatchRankLost leaves those out)."""
    if hasattr(sys.excepthook, "_syncwatch_original"):
        return
    excepthook, sys_exit = sys.excepthook, sys.exit

    def syncwatch_excepthook(kind, value, tb):
        global _end_reason
        _end_reason = "interrupted" if issubclass(kind, KeyboardInterrupt) else "failed"
        excepthook(kind, value, tb)

    def syncwatch_exit(status=None):
        global _end_reason
        if status not in (None, 0) and threading.current_thread() is threading.main_thread():
            _end_reason = "failed"
        sys_exit(status)
    syncwatch_excepthook._syncwatch_original = excepthook
    syncwatch_exit._syncwatch_original = sys_exit
    sys.excepthook, sys.exit = syncwatch_excepthook, syncwatch_exit


def _at_exit() -> None:
    shutdown(_end_reason or "completed")


def register(model=None, *, hook=None, state=None, collectives: bool = True) -> Handle:
    """Measure the gradient wait of a DDP ``model`` and, with ``collectives``, wrap the
    torch.distributed collectives. Without ``hook``, DDP keeps its built-in all-reduce (or any
    comm hook the script registers) and nothing runs per bucket; with ``hook``, it is registered
    as the model's comm hook (with ``state``) through ``ddp_hook_wrapper``. An FSDP model
    (``FullyShardedDataParallel`` or ``fully_shard``) needs nothing attached: its all-gathers and
    reduce-scatters are wrapped collectives. Never raises: what could not be attached is logged
    and counted."""
    from . import hooks
    handle = Handle()
    try:
        if model is not None:
            h = hooks.register_model(model, hook, state)
            handle.add(h.remove)
            if not collectives and hooks.is_fsdp(getattr(model, "_orig_mod", model)):
                log.warning("syncwatch: an FSDP model's waits are its collectives': with "
                            "collectives=False none of them is measured")
    except Exception as e:
        _register_failed("the model's gradient wait", e)
    try:  # apart: a model that could not be watched still leaves the collectives to wrap
        if collectives:
            h = hooks.patch_collectives()
            handle.add(h.remove)
    except Exception as e:
        _register_failed("the collective wrappers", e)
    return handle


def _register_failed(what: str, exc: Exception) -> None:
    """Logged once, here, and counted: a refused model in one line, anything else with its
    traceback (the monitor's log of its first error told it a second time)."""
    from .hooks import Refused
    if isinstance(exc, Refused):
        log.warning("syncwatch: could not register %s: %s", what, exc)
    else:
        log.warning("syncwatch: could not register %s", what, exc_info=exc)
    if _state.monitor is not None:
        _state.monitor._error(exc, logged=True)


def shutdown(reason: str = "completed") -> None:
    """Send the end record and stop the threads (bounded: a few seconds at most). ``reason``:
    completed, failed or interrupted (another is sent as failed, with a warning). Never raises."""
    m = _state.monitor
    if m is None:
        return
    _state.set_monitor(None)
    m.shutdown(reason)
