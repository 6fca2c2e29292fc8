"""Who this rank is: train job, attempt, rank, local rank, node, GPU.

Sources, in order: explicit arguments, ``torch.distributed`` (rank and world size when it is
initialized), the launcher's environment (torchrun/TorchElastic: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``; Slurm: ``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``; Kubernetes
operators set the torchrun variables, and the node name comes from ``SYNCWATCH_NODE`` or
``NODE_NAME`` set through the downward API, because a pod's hostname is the pod, not the node).
Label values are sanitized to the protocol's ``LABEL_RE`` instead of being rejected: a rank must
never fail to start because of an odd job name.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import uuid

from ..protocol import LABEL_MAX, MAX_ATTEMPT, Identity

_BAD = re.compile(r"[^A-Za-z0-9_.:@/+=-]")


def sanitize(value: str, fallback: str) -> str:
    """Map ``value`` onto the label alphabet: invalid characters -> ``_``; a value over the
    protocol's 128 characters is cut to 119 and ends in ``-`` and 8 hex digits of its hash, so
    that two long names alike in their first 128 (a sweep's runs named by their parameters) stay
    two jobs. Every rank of a job computes the same label."""
    text = str(value)
    value = _BAD.sub("_", text)
    if len(value) > LABEL_MAX:
        value = value[:LABEL_MAX - 9] + "-" + hashlib.blake2s(text.encode()).hexdigest()[:8]
    return value or fallback


def _env_int(env, *names: str, default: int | None = None) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is not None and raw.strip().lstrip("-").isdigit():
            return int(raw)
    return default


# torchrun's ``--rdzv-id`` default, exported as TORCHELASTIC_RUN_ID where torchrun generates no id
# (it does for ``--standalone`` and single-node runs without ``--master-port``): every multi-node
# job launched without ``--rdzv-id`` has it, so it names no job
TORCHRUN_NO_ID = "none"


def job_from_env(env=None) -> str | None:
    """The launcher's job id: ``SYNCWATCH_JOB``, ``TORCHELASTIC_RUN_ID`` (unless torchrun's
    placeholder ``none``), ``SLURM_JOB_ID``; None where there is none."""
    env = os.environ if env is None else env
    for name in ("SYNCWATCH_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = env.get(name)
        if value and not (name == "TORCHELASTIC_RUN_ID" and value == TORCHRUN_NO_ID):
            return sanitize(value, "job")
    return None


def attempt_from_env(env=None) -> int:
    """``SYNCWATCH_ATTEMPT``, else the launchers' restart counts, so that every restart of either
    launcher gives a higher attempt. Under Slurm with torchrun inside, a requeue starts a new
    torchrun whose ``TORCHELASTIC_RESTART_COUNT`` is 0 again: the launches are ordered by Slurm's
    count first, torchrun's (at most its ``TORCHELASTIC_MAX_RESTARTS``) within one, as
    ``slurm × (max restarts + 1) + torchrun``. At most ``MAX_ATTEMPT - 1``, the protocol's bound."""
    env = os.environ if env is None else env
    attempt = _env_int(env, "SYNCWATCH_ATTEMPT")
    if attempt is None:
        slurm = _env_int(env, "SLURM_RESTART_COUNT", default=0)
        torchrun = _env_int(env, "TORCHELASTIC_RESTART_COUNT", default=0)
        attempt = slurm * (_env_int(env, "TORCHELASTIC_MAX_RESTARTS", default=0) + 1) + torchrun
    return min(max(0, attempt), MAX_ATTEMPT - 1)


def node_from_env(env=None) -> str:
    env = os.environ if env is None else env
    return sanitize(env.get("SYNCWATCH_NODE") or env.get("NODE_NAME") or socket.gethostname(),
                    "node")


def generated_job() -> str:
    return "job-" + uuid.uuid4().hex[:12]


def cuda_uuid(index: int) -> str:
    """The GPU's UUID formatted like NVML (``GPU-xxxxxxxx-...``), "" if unknown."""
    try:
        import torch
        raw = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return ""
    return sanitize(raw if raw.startswith("GPU-") else "GPU-" + raw, "")


def rank_gpu(current: int, count: int, env=None) -> int:
    """The GPU this rank trains on: the current CUDA device, except where that is device 0 on
    a node of several GPUs while the launcher's local rank is not 0 (modulo the GPUs visible):
    the script never called ``torch.cuda.set_device`` and puts its work on the local rank's GPU
    with ``model.to(rank)``, as torch's DDP tutorial does; NCCL guesses that GPU the same way."""
    env = os.environ if env is None else env
    local = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID", default=0)
    if current == 0 and count > 1 and local % count:
        return local % count
    return current


def resolve(*, rank: int | None = None, world_size: int | None = None,
            local_rank: int | None = None, job: str | None = None, attempt: int | None = None,
            node: str | None = None, gpu: int = -1, gpu_uuid: str = "", env=None) -> Identity:
    """Build the identity from what is given, falling back to the environment."""
    env = os.environ if env is None else env
    if rank is None:
        rank = _env_int(env, "RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX", default=0)
    if world_size is None:
        world_size = _env_int(env, "WORLD_SIZE", "SLURM_NTASKS", default=rank + 1)
    if local_rank is None:
        local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID", default=0)
    return Identity(
        train_job=sanitize(job, "job") if job else (job_from_env(env) or generated_job()),
        attempt=attempt_from_env(env) if attempt is None else attempt,
        rank=rank, local_rank=local_rank, world_size=max(world_size, rank + 1),
        node=sanitize(node, "node") if node else node_from_env(env),
        pid=os.getpid(), gpu=gpu, gpu_uuid=gpu_uuid,
        # drawn anew for each monitor, whose counters start from 0: the daemon tells it from the
        # one before with the same pid (a container restarted in place, init() after shutdown)
        nonce=int.from_bytes(os.urandom(4), "little"))
