"""scripts/launch_server.sh and scripts/launch_worker.sh: help, argument checks, and dry runs
whose printed command the real parsers (xcls, torchrun) accept."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser as torchrun_parser

from xcls.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "scripts" / "launch_server.sh"
WORKER = ROOT / "scripts" / "launch_worker.sh"
# the variables launch_worker.sh reads, cleared so the caller's environment cannot leak in
WORKER_ENV = ("AMS_ADDRESSES", "AMS_SCHEDULER", "AMS_TOKEN_FILE", "AMS_TLS_CA_FILE", "NNODES",
              "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "METRICS_PORT",
              "MAX_RESTARTS", "RDZV_ENDPOINT", "RDZV_ID", "PYTHON")


def run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in WORKER_ENV}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=60, env={**clean, **env})


def dry_run(script: Path, *args: str, **env: str) -> list[str]:
    out = run(script, "--dry-run", *args, **env)
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout)


def xcls_args(argv: list[str]) -> object:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"xcls rejects {argv}: exit {e.code}")


@pytest.mark.parametrize("script", [SERVER, WORKER])
def test_help(script):
    out = run(script, "--help")
    assert out.returncode == 0 and out.stdout.startswith("Usage: scripts/"), out.stderr
    assert "--dry-run" in out.stdout


def test_scripts_are_strict_and_executable():
    for script in (SERVER, WORKER):
        assert "set -euo pipefail" in script.read_text()
        assert script.stat().st_mode & 0o111, f"{script} is not executable"


def test_server_dry_run_is_a_valid_shard_command():
    argv = dry_run(SERVER, "--auth-token-file", "/etc/xcls/token", "1", "4", "7002", "/data/ams",
                   PYTHON="py")
    assert argv[:3] == ["py", "-m", "xcls"]
    args = xcls_args(argv[3:])
    assert (args.command, args.role) == ("serve", "shard")
    assert (args.shard_id, args.num_shards, args.port) == (1, 4, 7002)
    assert args.host == "0.0.0.0" and str(args.auth_token_file) == "/etc/xcls/token"
    assert str(args.data_dir) == "/data/ams" and args.restore == "latest"


def test_server_with_a_scheduler_and_metrics():
    argv = dry_run(SERVER, "--scheduler", "sched:7000", "--advertise", "shardhost",
                   "--metrics-port", "9100", "--data-port", "7102", "1", "4", "7002",
                   "/data/ams", AMS_TOKEN_FILE="/etc/xcls/token")
    args = xcls_args(argv[3:])
    assert (args.scheduler, args.advertise) == ("sched:7000", "shardhost")
    assert (args.metrics_port, args.metrics_host) == (9100, "0.0.0.0")
    assert (args.port, args.data_port) == (7002, 7102)


@pytest.mark.parametrize("script", ["server", "worker"])
def test_a_scheduler_at_a_bracketed_ipv6_address_is_taken(script):
    if script == "server":
        argv = dry_run(SERVER, "--scheduler", "[::1]:7000", "1", "4", "7002", "/data/ams",
                       AMS_TOKEN_FILE="/etc/xcls/token")
        assert xcls_args(argv[3:]).scheduler == "[::1]:7000"
    else:
        argv = dry_run(WORKER, "--scheduler", "[::1]:7000", "exp.toml")
        assert "ams.scheduler=[::1]:7000" in argv


def test_server_with_tls_serves_tls_and_the_token():
    argv = dry_run(SERVER, "--tls-cert", "/etc/xcls/cert.pem", "--tls-key", "/etc/xcls/key.pem",
                   "--auth-token-file", "/etc/xcls/token", "0", "2", "7001", "/data/ams")
    args = xcls_args(argv[3:])
    assert (str(args.tls_cert), str(args.tls_key)) == ("/etc/xcls/cert.pem", "/etc/xcls/key.pem")
    assert str(args.auth_token_file) == "/etc/xcls/token"


# every case but the first two has a token file in the environment, so that exactly one
# thing is wrong in each
@pytest.mark.parametrize("argv, token, message", [
    (["0", "2", "7001", "/d"], "", "--auth-token-file FILE (or AMS_TOKEN_FILE) is required"),
    (["0", "2", "7001", "/d"], "/nonexistent/token", "missing or empty"),
    ([], "/t", "expected SHARD_ID"),
    (["0", "2", "7001", "/d", "/t"], "/t", "the token file goes in --auth-token-file"),
    (["0", "2", "7001", "/d", "--auth-token-file"], "/t", "--auth-token-file needs a value"),
    (["--scheduler", "sched", "0", "2", "7001", "/d"], "/t", "must be HOST:PORT"),
    (["--advertise", "h", "0", "2", "7001", "/d"], "/t", "--advertise needs --scheduler"),
    (["--metrics-port", "x", "0", "2", "7001", "/d"], "/t", "--metrics-port must be a number"),
    (["--data-port", "7x", "0", "2", "7001", "/d"], "/t", "--data-port must be a number"),
    (["0", "2", "70x1", "/d"], "/t", "PORT must be a number"),
    (["--bogus", "0", "2", "7001", "/d"], "/t", "unknown option"),
    (["--tls-cert", "c.pem", "0", "2", "7001", "/d"], "/t", "--tls-cert and --tls-key go"),
    (["--tls-key", "k.pem", "0", "2", "7001", "/d"], "/t", "--tls-cert and --tls-key go"),
])
def test_server_bad_args(argv, token, message):
    out = run(SERVER, *argv, AMS_TOKEN_FILE=token)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_worker_dry_run_in_collective_mode_starts_workers_without_shards():
    argv = dry_run(WORKER, "--collective", "--nproc-per-node", "2", "exp.toml")
    launch = torchrun_parser().parse_args(argv[3:])
    args = xcls_args(launch.training_script_args)
    assert args.overrides == ["head.placement=collective"]

    from xcls.config import load_config

    assert load_config(None, args.overrides).head.placement == "collective"


def test_worker_dry_run_is_a_valid_torchrun_command():
    argv = dry_run(WORKER, "--nnodes", "2", "--node-rank", "1", "--master-addr", "node0",
                   "--nproc-per-node", "8", "--ams", "s0:7001,s1:7001", "--auth-token-file",
                   "/etc/xcls/token", "exp.toml", "--set", "train.epochs=3")
    assert argv[1:3] == ["-m", "xcls.torchrun"]  # torchrun's flags, xcls's exit codes
    launch = torchrun_parser().parse_args(argv[3:])
    assert (launch.nnodes, launch.node_rank, launch.master_addr) == ("2", 1, "node0")
    assert launch.nproc_per_node == "8" and launch.module and launch.training_script == "xcls"
    assert launch.max_restarts == 3  # a rollback exits the workers with 75
    args = xcls_args(launch.training_script_args)
    assert args.command == "train" and str(args.config) == "exp.toml"
    assert args.overrides == ["ams.addresses=s0:7001,s1:7001", "ams.token_file=/etc/xcls/token",
                              "train.epochs=3"]

    from xcls.config import load_config

    cfg = load_config(None, args.overrides)  # the overrides are valid config fields
    assert cfg.ams.addresses == ["s0:7001", "s1:7001"]


def test_worker_c10d_rendezvous_is_elastic_and_passes_torchrun_flags():
    argv = dry_run(WORKER, "--nnodes", "2:4", "--rdzv-endpoint", "hostA:29400", "--rdzv-id",
                   "exp1", "--torchrun", "--monitor-interval=1", "--max-restarts", "5",
                   "--scheduler", "sched:7000", "exp.toml")
    launch = torchrun_parser().parse_args(argv[3:])
    assert (launch.nnodes, launch.rdzv_backend, launch.rdzv_endpoint, launch.rdzv_id) == (
        "2:4", "c10d", "hostA:29400", "exp1")
    assert launch.monitor_interval == 1 and launch.max_restarts == 5
    assert "--node-rank" not in argv and "--master-addr" not in argv  # c10d assigns ranks
    assert xcls_args(launch.training_script_args).overrides == ["ams.scheduler=sched:7000"]
    env = dry_run(WORKER, "exp.toml", AMS_ADDRESSES="h:1", RDZV_ENDPOINT="r:1", NNODES="1:3")
    launch = torchrun_parser().parse_args(env[3:])
    assert (launch.nnodes, launch.rdzv_endpoint, launch.rdzv_id) == ("1:3", "r:1", "xcls")


def test_worker_reads_the_environment():
    argv = dry_run(WORKER, "exp.toml", AMS_ADDRESSES="h:1", NNODES="3", NODE_RANK="2",
                   MASTER_ADDR="m", MASTER_PORT="1234", NPROC_PER_NODE="4")
    launch = torchrun_parser().parse_args(argv[3:])
    assert (launch.nnodes, launch.node_rank, launch.master_addr, launch.master_port,
            launch.nproc_per_node) == ("3", 2, "m", 1234, "4")
    assert "ams.addresses=h:1" in launch.training_script_args


def test_worker_numbers_with_leading_zeros_are_decimal():
    """08 is no octal number to the script: it is 8, in the command too."""
    argv = dry_run(WORKER, "--nnodes", "08:010", "--rdzv-endpoint", "r:1", "--ams", "h:1",
                   "--nproc-per-node", "02", "e.toml")
    launch = torchrun_parser().parse_args(argv[3:])
    assert (launch.nnodes, launch.nproc_per_node) == ("8:10", "2")
    argv = dry_run(WORKER, "--nnodes", "10", "--node-rank", "08", "--master-port", "029500",
                   "--max-restarts", "09", "--metrics-port", "09200", "--ams", "h:1", "e.toml")
    launch = torchrun_parser().parse_args(argv[3:])
    assert (launch.nnodes, launch.node_rank, launch.master_port, launch.max_restarts) == (
        "10", 8, 29500, 9)
    assert xcls_args(launch.training_script_args).metrics_port == 9200


def fake_python(tmp_path: Path, gpus: int) -> str:
    """A PYTHON whose torch sees ``gpus`` CUDA devices: the script asks it only that."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho {gpus}\n")
    python.chmod(0o755)
    return str(python)


def test_worker_runs_one_process_per_gpu_else_one(tmp_path):
    """The default: a worker per GPU torch sees, one on a host without CUDA (gloo), where an
    explicit 'gpu' is refused in one line rather than by torchrun's traceback."""
    nproc = {}
    for gpus in (4, 0):
        python = fake_python(tmp_path, gpus)
        for given in ([], ["--nproc-per-node", "gpu"]):
            out = run(WORKER, "--dry-run", *given, "--collective", "e.toml", PYTHON=python)
            nproc[gpus, bool(given)] = (out.returncode, out.stderr if out.returncode else
                                        torchrun_parser().parse_args(
                                            shlex.split(out.stdout)[3:]).nproc_per_node)
    assert nproc[4, False] == nproc[4, True] == (0, "4")
    assert nproc[0, False] == (0, "1")
    code, stderr = nproc[0, True]
    assert code == 2 and stderr.count("\n") == 1
    assert "--nproc-per-node gpu: torch sees no CUDA GPU" in stderr
    # the real torch, with every GPU hidden, as a CPU host's
    argv = dry_run(WORKER, "--collective", "e.toml", CUDA_VISIBLE_DEVICES="")
    assert torchrun_parser().parse_args(argv[3:]).nproc_per_node == "1"
    assert "one per" in run(WORKER, "--help").stdout.split("--nproc-per-node", 1)[1][:200]


def test_worker_with_a_scheduler_and_metrics():
    argv = dry_run(WORKER, "--scheduler", "sched:7000", "--metrics-port", "9200", "exp.toml",
                   "--set", "train.epochs=3")
    launch = torchrun_parser().parse_args(argv[3:])
    args = xcls_args(launch.training_script_args)
    assert args.overrides == ["ams.scheduler=sched:7000", "train.epochs=3"]
    assert (args.metrics_port, args.metrics_host) == (9200, "0.0.0.0")

    from xcls.config import load_config

    assert load_config(None, args.overrides).ams.scheduler == "sched:7000"


def test_worker_names_the_shards_tls_authority():
    argv = dry_run(WORKER, "--ams", "s0:7001", "--tls-ca", "/etc/xcls/ca.pem", "exp.toml")
    overrides = xcls_args(torchrun_parser().parse_args(argv[3:]).training_script_args).overrides
    assert overrides == ["ams.addresses=s0:7001", "ams.tls_ca_file=/etc/xcls/ca.pem"]
    env = dry_run(WORKER, "--ams", "s0:7001", "exp.toml", AMS_TLS_CA_FILE="/ca.pem")
    assert "ams.tls_ca_file=/ca.pem" in torchrun_parser().parse_args(env[3:]).training_script_args

    from xcls.config import load_config

    assert load_config(None, overrides).ams.tls_ca_file == "/etc/xcls/ca.pem"


@pytest.mark.parametrize("endpoint", [
    ["--standalone"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "nohost.invalid:1"],
    ["--nnodes", "2", "--master-addr", "127.0.0.1"],
])
def test_torchrun_on_one_host_keeps_torchruns_own_addresses(endpoint, monkeypatch):
    """``xcls.torchrun`` sets the rendezvous addresses only across hosts (tests/integration/
    test_multihost.py); on one host, or toward a name that does not resolve, it leaves
    torchrun's own."""
    from xcls.torchrun import meeting_point

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    args = torchrun_parser().parse_args([*endpoint, "-m", "xcls", "train", "exp.toml"])
    before = vars(args).copy()
    meeting_point(args)
    assert vars(args) == before and "GLOO_SOCKET_IFNAME" not in os.environ


@pytest.mark.parametrize("argv, message", [
    (["--ams", "h:1"], "CONFIG is required"),
    (["exp.toml"], "--ams (or AMS_ADDRESSES) or --scheduler"),
    (["--ams", "h:1", "--scheduler", "s:1", "e.toml"], "not both"),
    (["--collective", "--ams", "h:1", "e.toml"], "give no --ams or --scheduler"),
    (["--scheduler", "s", "e.toml"], "must be HOST:PORT"),
    (["--ams", "h:1", "--metrics-port", "p", "e.toml"], "--metrics-port must be a number"),
    (["--ams", "h:1", "--max-restarts", "-1", "e.toml"], "--max-restarts must be a number"),
    (["--ams"], "needs a value"),
    (["--ams", "h:1", "--node-rank", "2", "--nnodes", "2", "e.toml"], "must be below"),
    (["--ams", "h:1", "--nproc-per-node", "many", "e.toml"], "number or 'gpu'"),
    (["--ams", "h:1", "--frobnicate", "e.toml"], "unknown option"),
    (["--ams", "h:1", "--nnodes", "1:2", "e.toml"], "needs the c10d rendezvous"),
    (["--ams", "h:1", "--rdzv-endpoint", "r:1", "--nnodes", "3:2", "e.toml"], "MIN <= MAX"),
    (["--ams", "h:1", "--rdzv-endpoint", "r", "e.toml"], "--rdzv-endpoint must be HOST:PORT"),
    (["--ams", "h:1", "--rdzv-endpoint", "r:1", "--node-rank", "1", "e.toml"],
     "torchrun assigns the ranks"),
    (["--ams", "h:1", "--rdzv-id", "", "e.toml"], "--rdzv-id must be a non-empty word"),
    (["--ams", "h:1", "--torchrun"], "needs a value"),
    (["--collective", "--tls-ca", "ca.pem", "e.toml"], "with --collective there are none"),
    # a leading zero is decimal, not a failed octal number that skips the check
    (["--ams", "h:1", "--node-rank", "08", "e.toml"], "must be below"),
    (["--ams", "h:1", "--nnodes", "08", "--node-rank", "09", "e.toml"], "must be below"),
    (["--ams", "h:1", "--rdzv-endpoint", "r:1", "--nnodes", "09:08", "e.toml"], "MIN <= MAX"),
    (["--ams", "h:1", "--rdzv-endpoint", "r:1", "--nnodes", "00", "e.toml"], "MIN <= MAX"),
    (["--ams", "h:1", "--master-port", "08x", "e.toml"], "--master-port must be a number"),
    (["--ams", "h:1", "--nnodes", "x", "e.toml"], "--nnodes must be a number"),
])
def test_worker_bad_args(argv, message):
    out = run(WORKER, "--dry-run", *argv)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert out.stdout == "" and out.stderr.count("\n") == 1, out.stderr  # one line, no command


@pytest.mark.parametrize("env, expect_py, expect_venv", [
    ({"VIRTUAL_ENV": "/opt/mine"}, "/opt/mine/bin/python", ""),
    ({"PYTHON": "/usr/bin/python3.12"}, "/usr/bin/python3.12", ""),
    ({}, str(ROOT / ".venv" / "bin" / "python"), str(ROOT / ".venv")),
])
def test_setup_scripts_pick_the_python_environment(env, expect_py, expect_venv):
    """setup.sh, demo.sh and test.sh share scripts/env.sh: an active virtual environment, then
    $PYTHON, then the project's .venv, whose bin/ then comes first on PATH."""
    clean = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")}
    out = subprocess.run(
        ["bash", "-c", f'source {ROOT}/scripts/env.sh; echo "$XCLS_PY"; echo "${{XCLS_VENV:-}}";'
         ' echo "${PATH%%:*}"'],
        cwd="/", capture_output=True, text=True, check=True,
        env={**clean, **env}).stdout.splitlines()
    assert out[0] == expect_py and out[1] == expect_venv
    assert (out[2] == f"{expect_venv}/bin") == bool(expect_venv)


@pytest.mark.parametrize("script, extra", [("demo.sh", ["--set", "train.epochs=1"]),
                                           ("demo.sh", []), ("test.sh", ["-k", "nothing"])])
def test_setup_scripts_run_xcls_with_the_chosen_python(script, extra, tmp_path):
    """With PYTHON=... and no xcls on PATH, every command the scripts run goes through that
    interpreter (here a stand-in that records its arguments), and the script succeeds."""
    log = tmp_path / "calls"
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\n')
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(python),
           "XCLS_SKIP_APT": "1"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / script), *extra], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    assert any(c.startswith("-m pip install") for c in calls), calls  # setup.sh's
    if script == "demo.sh":
        train = " ".join(["-m xcls train configs/glyphs-2k-knn.toml", *extra])
        evaluate = " ".join(["-m xcls eval --rows class-means configs/glyphs-2k-knn.toml", *extra])
        assert train in calls and evaluate in calls, calls
        assert any(c.startswith("benchmarks/demo.py") for c in calls) == (not extra), calls
    else:
        assert "-m ruff check ." in calls and "-m pytest -q -n 2 -k nothing" in calls, calls
