"""Multi-host launch through JAX's multi-controller runtime.

Every process runs the same command with its own `--process-id`:

    python -m mk logits --checkpoint DIR --tokens 5,17,3 --out x.npy --mesh 8 \\
        --coordinator HOST:PORT --num-processes 2 --process-id 0      # and 1 on the other host

`initialize` connects to the coordinator (process 0 serves it at HOST:PORT), after which
`jax.devices()` lists every process's devices (sorted by process, then id: rank r of
`mk.model.sharding.make_mesh` lives on process r // local devices) and a step over the global mesh runs
in all processes together. On CPU the cross-process collectives go through gloo. Bad launches
(process ids out of range or taken twice, processes started with different `--num-processes`, a
coordinator that does not answer within `timeout_s`) raise `DistributedError`, a one-line
`UserError`, in every process concerned: before joining the JAX runtime (whose coordination
service aborts the process on a failed registration) the processes check in with process 0 on
the coordinator's port + 1 (`handshake`), so that port must be free too.
"""
from __future__ import annotations

import os
import re

from mk.errors import UserError

DEFAULT_TIMEOUT_S = 60


class DistributedError(UserError):
    """A multi-process launch that cannot work; the message names the option at fault."""


def add_distributed_args(parser, mesh: bool = True):
    """--coordinator HOST:PORT, --num-processes N, --process-id I (all three, or none), and
    (with mesh=True) --mesh N: run the step sharded over N devices by mk.model.sharding's rule."""
    g = parser.add_argument_group("multi-device / multi-process (see mk.cli.distributed)")
    if mesh:
        g.add_argument("--mesh", type=int, default=None, metavar="N",
                       help="split the step over N devices (mk.model.sharding; on CPU set "
                            "XLA_FLAGS=--xla_force_host_platform_device_count=N); default: all "
                            "devices of a multi-process job, else unsharded")
    g.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="address of process 0's coordinator service (enables multi-process; "
                        "PORT + 1 must be free too: mk's launch check)")
    g.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes in the job")
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="this process, 0..N-1")
    g.add_argument("--distributed-timeout", type=int, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the coordinator and the other processes (default {DEFAULT_TIMEOUT_S})")
    return g


def check_args(coordinator, num_processes, process_id) -> bool:
    """Validate the three options; True if a multi-process launch is requested."""
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if not any(given):
        return False
    if not all(given):
        raise DistributedError("multi-process launch needs all of --coordinator HOST:PORT, "
                               "--num-processes N and --process-id I")
    if not re.fullmatch(r"[^\s:]+:\d{1,5}|\[[0-9a-fA-F:.]+\]:\d{1,5}", coordinator) or \
            not 0 < int(coordinator.rsplit(":", 1)[1]) < 65536:
        raise DistributedError(f"--coordinator: expected HOST:PORT, found {coordinator!r}")
    if num_processes < 1:
        raise DistributedError(f"--num-processes must be >= 1, found {num_processes}")
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"--process-id must lie in 0..{num_processes - 1} "
                               f"(--num-processes {num_processes}), found {process_id}")
    return True


def initialize(coordinator: str, num_processes: int, process_id: int, *,
               timeout_s: int = DEFAULT_TIMEOUT_S) -> None:
    """`jax.distributed.initialize` with mk's launch check; call before any other JAX use.

    First every process checks in with process 0 over a plain TCP socket on the coordinator's
    port + 1 (`handshake`): mismatched --num-processes, a process id out of the coordinator's range
    or taken twice, and an unreachable coordinator become a one-line `DistributedError` in every
    process involved, within `timeout_s`, instead of a C++ abort (which is what the XLA
    coordination service does on a failed registration).
    """
    check_args(coordinator, num_processes, process_id)
    handshake(coordinator, num_processes, process_id, timeout_s)
    import jax

    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=max(10, timeout_s),
                                   shutdown_timeout_seconds=max(10, timeout_s))
    except Exception as e:  # XlaRuntimeError / RuntimeError / ValueError from the runtime
        first = next((l.strip() for l in str(e).splitlines() if l.strip()), type(e).__name__)
        raise DistributedError(f"process {process_id} of {num_processes}: cannot join the job at "
                               f"{coordinator} within {timeout_s} s ({first[:300]})") from None


def handshake(coordinator: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """The launch check of `initialize`, on TCP port (coordinator port + 1).

    Process 0 listens and waits for the other N-1 to report (num_processes, process_id); it
    answers each with its own N and a verdict. Any disagreement raises `DistributedError` in the
    processes concerned (and in process 0, naming the culprit)."""
    import json
    import socket
    import time

    host, port = coordinator.rsplit(":", 1)
    host, port = host.strip("[]"), int(port) + 1
    where = f"{host}:{port} (--coordinator port + 1)"
    deadline = time.monotonic() + timeout_s
    if num_processes == 1:
        return
    if process_id == 0:
        heard: dict[int, object] = {}                       # process id -> its open connection
        problem = ""
        try:
            srv = socket.create_server(("", port))
        except OSError as e:
            raise DistributedError(f"process 0: cannot listen on port {port} (--coordinator port + 1, "
                                   f"mk's launch check): {e.strerror or e}") from None
        try:
            with srv:
                while len(heard) < num_processes - 1 and not problem:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = [i for i in range(1, num_processes) if i not in heard]
                        problem = (f"process(es) {missing} did not check in at {where} within "
                                   f"{timeout_s} s")
                        break
                    srv.settimeout(left)
                    try:
                        conn, _ = srv.accept()
                    except socket.timeout:
                        continue
                    conn.settimeout(max(1.0, deadline - time.monotonic()))
                    try:
                        msg = json.loads(conn.makefile("r").readline())
                        n, pid = int(msg["n"]), int(msg["id"])
                    except (OSError, ValueError, KeyError, TypeError):
                        conn.close()                        # not one of ours: ignore
                        continue
                    if n != num_processes:
                        problem = (f"process {pid} was started with --num-processes {n} but process 0 "
                                   f"with {num_processes}: every process needs the same --num-processes")
                    elif not 0 < pid < num_processes:
                        problem = (f"--process-id {pid} is not one of 1..{num_processes - 1} "
                                   f"(--num-processes {num_processes}; 0 is the coordinator)")
                    elif pid in heard:
                        problem = f"two processes were started with --process-id {pid}"
                    if problem:
                        _reply(conn, num_processes, problem)   # the others hear it below
                    else:
                        heard[pid] = conn
        finally:
            for conn in heard.values():                     # everyone hears the verdict at once
                _reply(conn, num_processes, problem)
        if problem:
            raise DistributedError(f"process 0 of {num_processes}: {problem}")
        return
    while True:                                             # a non-coordinator process
        try:
            with socket.create_connection((host, port), timeout=max(0.5, deadline - time.monotonic())) as c:
                c.settimeout(timeout_s + 5)                 # process 0 answers once all checked in
                c.sendall((json.dumps({"n": num_processes, "id": process_id}) + "\n").encode())
                reply = json.loads(c.makefile("r").readline())
            break
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                raise DistributedError(f"process {process_id} of {num_processes}: the coordinator (process "
                                       f"0) did not answer at {where} within {timeout_s} s (is it "
                                       f"running, at that address?)") from None
            time.sleep(0.2)
    if reply.get("why"):
        raise DistributedError(f"process {process_id} of {num_processes}: {reply['why']}")


def _reply(conn, n: int, why: str):
    import json
    try:
        conn.sendall((json.dumps({"n": n, "why": why}) + "\n").encode())
    except OSError:
        pass
    finally:
        conn.close()


def from_args(args) -> bool:
    """Initialize from parsed `add_distributed_args` options; True if multi-process."""
    if not check_args(args.coordinator, args.num_processes, args.process_id):
        return False
    initialize(args.coordinator, args.num_processes, args.process_id,
               timeout_s=getattr(args, "distributed_timeout", DEFAULT_TIMEOUT_S))
    return True


def mesh_from_args(args, cfg, backend: str = "reference"):
    """Initialize a multi-process job if asked, then the mesh of `--mesh N` (None: unsharded).

    In a multi-process job the mesh spans every device of every process (default N)."""
    multi = from_args(args)
    n = getattr(args, "mesh", None)
    if n is None and not multi:
        return None
    import jax

    total = jax.device_count()
    n = total if n is None else n
    if n < 1:
        raise DistributedError(f"--mesh must be >= 1, found {n}")
    if n > total:
        raise DistributedError(f"--mesh {n}: only {total} devices ({jax.process_count()} process(es) x "
                               f"{jax.local_device_count()}); on CPU set "
                               f"XLA_FLAGS=--xla_force_host_platform_device_count=N")
    if multi and n != total:
        raise DistributedError(f"--mesh {n}: a multi-process mesh spans all {total} devices of the job")
    from mk.model.reference_sharded import mesh_for
    return mesh_for(cfg, n)


def is_main_process() -> bool:
    import jax
    return jax.process_index() == 0


__all__ = ["DistributedError", "add_distributed_args", "check_args", "initialize", "from_args",
           "mesh_from_args", "is_main_process"]
