#!/bin/sh
# Slurm TaskProlog for syncwatch (slurm.conf: TaskProlog=/etc/slurm/syncwatch-task-prolog.sh).
#
# Slurm runs this before every task of every job, as the job's user, and turns each
# "export NAME=value" line it prints into the task's environment. It labels the task's
# syncwatch records with the Slurm job:
#
#   SYNCWATCH_JOB     train_job label = SLURM_JOB_ID. The instrumentation falls back to
#                     SLURM_JOB_ID on its own, but only after TORCHELASTIC_RUN_ID, torchrun's
#                     rendezvous id (--rdzv-id, or one --standalone generates): with this line
#                     the Slurm job id is the label whatever the launcher.
#   SYNCWATCH_SOCKET  the node daemon's ingest socket (syncwatch.socket).
#
# A value the user already set (in the batch script or with --export) is kept. Prints nothing
# outside a Slurm job. Never fails the task: a prolog error would fail the user's job.

socket=/run/syncwatch/ingest.sock

if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SYNCWATCH_JOB:-}" ]; then
    echo "export SYNCWATCH_JOB=${SLURM_JOB_ID}"
fi
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SYNCWATCH_SOCKET:-}" ] && [ -z "${SYNCWATCH_UDP:-}" ]; then
    echo "export SYNCWATCH_SOCKET=${socket}"
fi
exit 0
