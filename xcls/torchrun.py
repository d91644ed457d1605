"""``python -m xcls.torchrun``: torchrun as xcls's launchers run it.

The same flags as ``torchrun`` (``python -m torch.distributed.run``), and the same elastic agent,
with three differences that make a worker group's end read as what it was:

* **A refusal is final.** A worker that refuses its input (exit 2: a config typo, a dataset
  that is not there) would refuse it again, so the group is not restarted, whatever
  ``--max-restarts`` says: the launcher exits 2 at once and prints the worker's one line, once
  (``xcls train`` leaves it in torchrun's error file). torchrun restarts it, and the next
  rendezvous fails or hangs for good. Any other failure, the rollback exit 75 above all,
  restarts the group as before.
* **A stop is a stop.** SIGTERM or SIGINT (``docker compose down``, a scheduler, Ctrl-C) is
  passed to the workers, which checkpoint at the next step boundary and exit; the launcher then
  exits 128 + the signal's number (143 for SIGTERM, as a worker that stopped on it does),
  without torchrun's ``SignalException`` traceback.
* **One line for a failure.** When the group fails past its restarts, one log line names the
  rank and its exit code, and the launcher exits with that code (torchrun printed a report
  of the failure and a traceback, and exited 1).

* **Hosts meet where they can reach each other.** Across hosts, torchrun hands the workers
  ``MASTER_ADDR`` from rank 0's host name, hosts the c10d store where the endpoint matches this
  host's name, and gloo binds where the name resolves; on Debian the name resolves to
  127.0.1.1, and hosts that share a name (containers, network namespaces) resolve it alike,
  so nobody hosted the store, or a worker was handed another host's loopback. Here they come
  from the route toward the rendezvous host instead (``meeting_point``), unless given
  (``--local-addr``, ``--rdzv-conf is_host=...``, ``GLOO_SOCKET_IFNAME``).

A restarted group also gets a rendezvous store of its own
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, docs/reliability.md), so ``xcls cluster up``,
``scripts/launch_worker.sh`` and the compose file's worker need not each remember it.
A rendezvous that fails (an endpoint nobody serves) is one line and exit 1.

    python -m xcls.torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        -m xcls train configs/glyphs-2k-knn.toml
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import logging
import os
import signal
import socket
import struct
import sys

from torch.distributed import run as torch_run
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher import api as launcher_api

from workers.distributed import address_toward
from workers.termination import EXIT_TERMINATED
from xcls.cli import EXIT_BAD_INPUT
from xcls.logs import setup_logging
from xcls.parent import exit_with_parent

log = logging.getLogger("xcls.torchrun")

# A restarted group must not read the addresses of the group before it from torchrun's shared
# store (pytorch issue 135712); a store per restart avoids that.
RESTARTABLE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# Exits that end the job rather than ask for a restart: a refusal, which every attempt would
# repeat, and a stop on SIGTERM sent to the workers themselves (they checkpointed and said so;
# a restart would train on past the stop asked for).
FINAL_EXIT_CODES = (EXIT_BAD_INPUT, EXIT_TERMINATED)


class RefusalFinalAgent(LocalElasticAgent):
    """torchrun's agent, except that a group one of whose workers exited with one of
    ``FINAL_EXIT_CODES`` is not restarted."""

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and any(
                f.exitcode in FINAL_EXIT_CODES for f in result.failures.values()):
            self._remaining_restarts = 0
        return result


# ioctl(2) request for an interface's IPv4 address (linux/sockios.h)
_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The network interface whose (first) IPv4 address is ``address``; None when none is, or
    for an IPv6 address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                    struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def meeting_point(args: argparse.Namespace) -> None:
    """Across hosts, set what torchrun and gloo would take from this host's name from the
    route toward the rendezvous host (the c10d endpoint, or the static ``--master-addr``):
    ``--local-addr`` (the ``MASTER_ADDR`` the workers get when this host has rank 0), c10d's
    ``is_host`` (whether this host serves the rendezvous store: the endpoint is one of its
    addresses) and ``GLOO_SOCKET_IFNAME`` (the interface that holds that address), each unless
    given. Nothing changes for one host (``--standalone``, a loopback route) or when the
    rendezvous host does not resolve (torchrun then says so)."""
    if args.standalone:
        return
    if args.rdzv_backend == "c10d":
        host = parse_rendezvous_endpoint(args.rdzv_endpoint, 29400)[0]
    elif torch_run.parse_min_max_nnodes(args.nnodes)[1] > 1:
        host = args.master_addr
    else:
        return
    try:
        peer = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0][4][0]
        own = address_toward(peer)
    except (OSError, ValueError):
        return
    if ipaddress.ip_address(own).is_loopback:
        return
    if args.rdzv_backend == "c10d":
        if args.local_addr is None:
            args.local_addr = own
        if "is_host=" not in args.rdzv_conf:
            is_host = f"is_host={'true' if own == peer else 'false'}"
            args.rdzv_conf = f"{args.rdzv_conf},{is_host}" if args.rdzv_conf else is_host
    interface = interface_of(own)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    log.info("meeting_point rendezvous_host=%s local_addr=%s rdzv_conf=%s gloo_socket_ifname=%s",
             host, args.local_addr or "", args.rdzv_conf or "",
             os.environ.get("GLOO_SOCKET_IFNAME", ""))


def first_failure(error: ChildFailedError) -> tuple[int, ProcessFailure]:
    """(rank, failure) that ended the group: a refusal if any rank refused, else the lowest
    rank's failure."""
    failures = sorted(error.failures.items())
    return next(((r, f) for r, f in failures if f.exitcode == EXIT_BAD_INPUT), failures[0])


def main(argv: list[str] | None = None) -> int:
    """Parse torchrun's flags, run the group, and exit as the module docstring says."""
    parser = torch_run.get_args_parser()
    parser.prog = "python -m xcls.torchrun"
    parser.description = __doc__.split("\n\n")[0] + ": " + " ".join(
        __doc__.split("\n\n")[1].split())
    args = parser.parse_args(argv)
    setup_logging(0)
    # torchrun's own narration (the OMP_NUM_THREADS banner, "failed (exitcode: 2)", "Sending
    # process ... closing signal") is what this module sums up in one line
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):  # each has its own level (env LOGLEVEL)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    for key, value in RESTARTABLE_ENV.items():
        os.environ.setdefault(key, value)
    launcher_api.LocalElasticAgent = RefusalFinalAgent
    meeting_point(args)
    try:
        torch_run.run(args)
    except RendezvousError as e:
        cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
        log.error("rendezvous_failed endpoint=%s error=%s%s", args.rdzv_endpoint or
                  f"{args.master_addr}:{args.master_port}", e, cause)
        return 1
    except SignalException as e:
        # the workers said where they stopped ("stopped by SIGTERM after step N, checkpoint
        # saved"): that is the one line of a clean stop
        log.debug("workers_stopped signal=%s", signal.Signals(e.sigval).name)
        return 128 + e.sigval
    except ChildFailedError as e:
        rank, failure = first_failure(e)
        if failure.exitcode == EXIT_BAD_INPUT:
            # the worker's one line (xcls train writes it to torchrun's error file)
            print(failure.message if isinstance(failure.message, str) else
                  f"error: rank {rank} refused its input", file=sys.stderr)
            return EXIT_BAD_INPUT
        if failure.exitcode == EXIT_TERMINATED:  # the workers' own line says where they stopped
            return EXIT_TERMINATED
        code = failure.exitcode
        code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says
        log.error("workers_failed rank=%d exit_code=%d restarts=%d", rank, code,
                  args.max_restarts)
        return code
    return 0


if __name__ == "__main__":
    exit_with_parent()
    sys.exit(main())
