"""The worker's environment contract: every ``EFDL_*`` variable an agent sets for its workers
and a worker reads, in one place (torchrun's own, RANK, LOCAL_RANK, MASTER_ADDR..., are set
beside them: efdl.launcher.env.worker_env).

efdl-run's own options read ``EFDL_<OPTION>`` (efdl.config: flags > EFDL_* > YAML >
defaults); the secrets among them (``EFDL_ETCD_PASSWORD``, ``EFDL_JOB_TOKEN``) never reach a
worker (:data:`SECRET_VARIABLES`).
"""

from __future__ import annotations

# ---------------------------------------------------------------- secrets, never a worker's
PASSWORD_ENV = "EFDL_ETCD_PASSWORD"
JOB_TOKEN_ENV = "EFDL_JOB_TOKEN"
# The etcd user a job token authenticates as: the etcd a node of the job serves has one user,
# etcd's root, whose password is the token.
JOB_TOKEN_USER = "root"
# Secrets an efdl process may be given in its environment: never passed on to the workers (a
# training script, and what it starts, has no business with etcd) nor to an etcd it starts.
SECRET_VARIABLES = frozenset({PASSWORD_ENV, JOB_TOKEN_ENV})

# ---------------------------------------------------------------- who and where the worker is
JOB_ID_ENV = "EFDL_JOB_ID"
NODE_ID_ENV = "EFDL_NODE_ID"
GENERATION_ENV = "EFDL_GENERATION"  # the generation the worker was started in
LOCAL_RANK_ENV = "EFDL_LOCAL_RANK"  # the worker's local rank, also where LOCAL_RANK says 0
DEVICE_ENV = "EFDL_CUDA_DEVICE"  # the index of the worker's own GPU in its CUDA_VISIBLE_DEVICES
WARM_ENV = "EFDL_WARM"  # "1": the worker started warm (torch imported ahead of need)
# The job's newest committed step as the agent knew it when it placed the worker, and the
# generation that committed it (efdl.protocol.messages.Placement.job_step).
JOB_STEP_ENV = "EFDL_JOB_STEP"
JOB_GENERATION_ENV = "EFDL_JOB_GENERATION"
# Set for a worker started to replace one that died in place: it waits, connected to its
# agent, for a round that places it, instead of joining the generation of its environment.
STANDBY_ENV = "EFDL_STANDBY"

# ---------------------------------------------------------------- how it reaches its agent
SOCKET_ENV = "EFDL_AGENT_SOCKET"  # the agent's channel (efdl.worker.channel)
BEAT_DIR_ENV = "EFDL_BEAT_DIR"  # where it writes its beat (efdl.worker.hang)
FENCE_ENV = "EFDL_FENCE_FILE"  # its commits' deadline, written by the agent (efdl.worker.fence)

# ---------------------------------------------------------------- its timeouts
GRACE_ENV = "EFDL_GRACE_PERIOD"  # how long a worker that was asked to leave may take
# How long a worker waits for its next placement after leaving a generation (a lost member is
# noticed within the lease TTL), and how long the job may wait below --min or for all ranks.
PLACEMENT_TIMEOUT_ENV = "EFDL_PLACEMENT_TIMEOUT"
JOIN_TIMEOUT_ENV = "EFDL_JOIN_TIMEOUT"
STRAGGLER_WINDOW_ENV = "EFDL_STRAGGLER_WINDOW"  # steps per pace judgment (efdl.worker.pace)
MIN_STRAGGLER_WINDOW = 5  # fewer steps and one slow step would sway the median
HANG_TIMEOUT_ENV = "EFDL_HANG_TIMEOUT"  # --hang-timeout, for the worker's hang watch
COLLECTIVE_TIMEOUT_ENV = "EFDL_COLLECTIVE_TIMEOUT"  # the process groups' timeout (seconds)

# ---------------------------------------------------------------- the user's knobs
SYNC_BUCKET_ENV = "EFDL_SYNC_BUCKET_MB"  # the state sync's bucket size
# N: this host has N simulated GPUs instead of what NVML finds (efdl.launcher.gpus.discover),
# to try the fleet (efdl node, efdl submit) on hosts without GPUs; their workers use the CPU.
SIMULATED_GPUS_ENV = "EFDL_SIMULATED_GPUS"
DATA_SHM_ENV = "EFDL_DATA_SHM"  # where efdl.data's exchange keeps its windows
# The remote cache (efdl.worker.cache.CacheSettings.to_env).
CACHE_URL_ENV = "EFDL_CACHE_URL"
CACHE_EVERY_STEPS_ENV = "EFDL_CACHE_EVERY_STEPS"
CACHE_EVERY_ENV = "EFDL_CACHE_EVERY"
CACHE_KEEP_ENV = "EFDL_CACHE_KEEP"
PEER_COPIES_ENV = "EFDL_PEER_COPIES"  # --peer-copies: commits between peer copies (0: none)
NODE_HOST_ENV = "EFDL_NODE_HOST"  # the node's address (--host), where a worker serves copies
