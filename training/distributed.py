"""Multi-process start-up on JAX's own runtime (``jax.distributed``).

``initialize`` either takes explicit ``coordinator / num_processes / process_id`` (the
``--coordinator HOST:PORT --num-processes N --process-id I`` flags) or lets JAX detect the
cluster from its environment: SLURM (``srun``), Open MPI (``mpirun``) and Kubernetes
(JobSet / indexed Jobs; needs the ``kubernetes`` package). A lone process does nothing.
On CPU, collectives across processes go through gloo.

A dead peer: every process sends heartbeats to the coordination service (on process 0);
when one stops for ``heartbeat_timeout_s`` (``--heartbeat-timeout``, JAX's default 100 s),
the service tells every survivor, which then aborts (exit status 134) with "The following
tasks are unhealthy (stopped sending heartbeats): <process ids>" rather than hang in a
collective. If process 0 itself dies, the others lose the service and abort at once with
"Failed to send RPC to coordination service. Either the leader task was …". Restart them
all with ``--resume``.

    >>> # needs process 1 and a JAX that has not started yet:
    >>> initialize(coordinator="127.0.0.1:1234", num_processes=2, process_id=0)  # doctest: +SKIP
    'explicit: process 0 of 2 via 127.0.0.1:1234'
    >>> initialize(coordinator="127.0.0.1:1234")
    Traceback (most recent call last):
    ...
    ValueError: multi-process runs need all of --coordinator HOST:PORT, --num-processes N and --process-id I (or none, to auto-detect)
"""
from __future__ import annotations

import os
from typing import Optional

import jax

from triax.training.gloo_notice import drop_gloo_notices

# Environment markers of the launchers JAX's cluster detection understands, with the
# variable holding the process count.
CLUSTERS = (("slurm", "SLURM_JOB_ID", "SLURM_NTASKS"),
            ("open-mpi", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
            ("kubernetes", "KUBERNETES_SERVICE_HOST", None))


def detect_cluster() -> Optional[str]:
    """The launcher we are under, if it started more than one process."""
    for name, marker, count in CLUSTERS:
        if marker in os.environ:
            if count is None or int(os.environ.get(count, "1") or 1) > 1:
                return name
    return None


def _use_gloo_on_cpu() -> None:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms in ("", "cpu") or platforms.startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        drop_gloo_notices()


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None,
               heartbeat_timeout_s: Optional[int] = None) -> str:
    """Start ``jax.distributed`` if asked or under a multi-process launcher; say how.
    ``heartbeat_timeout_s``: how long a silent process may stay silent before the others
    give it up for dead and exit (None: JAX's default)."""
    timeouts = ({} if heartbeat_timeout_s is None
                else {"heartbeat_timeout_seconds": int(heartbeat_timeout_s)})
    if heartbeat_timeout_s is not None and heartbeat_timeout_s < 1:
        raise ValueError(f"--heartbeat-timeout {heartbeat_timeout_s}: give at least 1 second")
    explicit = [coordinator, num_processes, process_id]
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ValueError("multi-process runs need all of --coordinator HOST:PORT, "
                             "--num-processes N and --process-id I (or none, to auto-detect)")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id} must be in [0, {num_processes})")
        if ":" not in coordinator:
            raise ValueError(f"--coordinator {coordinator!r}: expected HOST:PORT")
        _use_gloo_on_cpu()
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id,
                                   **timeouts)
        return f"explicit: process {process_id} of {num_processes} via {coordinator}"
    cluster = detect_cluster()
    if cluster is None:
        return "single process"
    _use_gloo_on_cpu()
    jax.distributed.initialize(**timeouts)
    return f"{cluster}: process {jax.process_index()} of {jax.process_count()}"


def is_main_process() -> bool:
    return jax.process_index() == 0
