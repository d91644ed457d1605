"""docker-compose.yml and Dockerfile, checked without a Docker engine: the file parses, every
role's command is one the real parsers (xcls, torchrun) accept, and the roles agree with each
other (shard ids and count, addresses in shard order, volumes, secrets, mounted paths)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser as torchrun_parser

from xcls.cli import build_parser
from xcls.config import load_config

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
XCLS_ROLES = {name: s for name, s in SERVICES.items() if s.get("image") == "xcls:latest"}
SHARDS = sorted(name for name in SERVICES if re.fullmatch(r"shard-\d+", name))


def xcls_args(argv: list[str], where: str) -> object:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: xcls rejects {argv} (exit {e.code})")


def parsed(name: str) -> object:
    """The xcls arguments of a role, through torchrun when that is its entrypoint."""
    service = SERVICES[name]
    command = [str(a) for a in service["command"]]
    entrypoint = service.get("entrypoint")
    if entrypoint is None:  # the image's ENTRYPOINT ["xcls"]
        return xcls_args(command, name)
    # torchrun's flags; a refusal is not restarted, SIGTERM is a clean stop (xcls.torchrun)
    assert entrypoint == ["python", "-m", "xcls.torchrun"], entrypoint
    launch = torchrun_parser().parse_args(command)
    assert launch.module and launch.training_script == "xcls", command
    return xcls_args(launch.training_script_args, name)


def shard_addresses() -> list[str]:
    """host:port of each shard service, in shard order."""
    return [f"{name}:{parsed(name).port}" for name in SHARDS]


def resolved(value: str) -> str:
    """``value`` with compose's ${VAR:-default} written as its default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_one_image_is_built_once_for_every_role():
    built = [name for name, s in SERVICES.items() if "build" in s]
    assert built == ["scheduler"], built  # compose built the same image once per service
    assert SERVICES["scheduler"]["build"] == {"context": ".", "network": "host"}
    assert set(XCLS_ROLES) == set(SERVICES) - {"redis"}
    assert all(s["pull_policy"] == "never" for s in XCLS_ROLES.values())


def test_a_run_owns_its_shards_data_dir():
    """Runs sharing one --data-dir contaminated each other: a new run started from the last
    one's rows and its step-0 snapshot was pruned among the old run's steps."""
    out_dir = load_config(ROOT / "configs" / "glyphs-2k-knn.toml",
                          [resolved(o) for o in parsed("worker").overrides]).train.out_dir
    assert "${XCLS_RUN:-" in " ".join(SERVICES["worker"]["command"])
    for name in SHARDS:
        assert resolved(str(parsed(name).data_dir)) == out_dir + "/ams", name


def test_redis_only_with_the_gear_profile():
    """Nothing in the default cluster uses Redis (gear mode is off), so it is not started."""
    assert SERVICES["redis"]["profiles"] == ["gear"]
    assert all("redis" not in s.get("depends_on", {}) for s in SERVICES.values())


def test_roles_present():
    assert len(SHARDS) >= 2
    assert {"scheduler", "graph-build", "worker", "redis"} <= set(SERVICES)


def test_scheduler_knows_every_shard_and_every_shard_registers():
    scheduler = parsed("scheduler")
    assert (scheduler.command, scheduler.role, scheduler.host) == ("serve", "scheduler",
                                                                    "0.0.0.0")
    assert scheduler.num_shards == len(SHARDS)
    assert str(scheduler.auth_token_file) == "/run/secrets/ams_token"
    assert f"127.0.0.1:{scheduler.port}" in " ".join(SERVICES["scheduler"]["healthcheck"]["test"])
    for name in SHARDS:
        a = parsed(name)
        assert (a.scheduler, a.advertise) == (f"scheduler:{scheduler.port}", name), name
        assert SERVICES[name]["depends_on"]["scheduler"]["condition"] == "service_healthy"
        assert SERVICES[name]["restart"] == "on-failure", name  # a fenced shard exits 3


def test_shards_are_one_consistent_cluster():
    args = [parsed(name) for name in SHARDS]
    assert [a.shard_id for a in args] == list(range(len(SHARDS)))
    assert {a.num_shards for a in args} == {len(SHARDS)}
    assert len({a.port for a in args}) == len(SHARDS)
    for name, a in zip(SHARDS, args, strict=True):
        assert (a.command, a.role, a.host) == ("serve", "shard", "0.0.0.0"), name
        # a non-loopback bind needs the token; it must be a secret the service mounts
        assert str(a.auth_token_file) == "/run/secrets/ams_token", name
        assert "ams_token" in SERVICES[name]["secrets"], name
        assert str(a.data_dir).startswith("/shared/"), name
        health = " ".join(SERVICES[name]["healthcheck"]["test"])
        assert f"127.0.0.1:{a.port}" in health, name
        compile(SERVICES[name]["healthcheck"]["test"][3], f"{name} healthcheck", "exec")


def test_graph_builder_addresses_all_shards_and_the_worker_the_scheduler():
    graph = parsed("graph-build")
    assert (graph.command, graph.graph_command) == ("graph", "build")
    assert graph.ams.split(",") == shard_addresses()
    assert str(graph.auth_token_file) == "/run/secrets/ams_token"

    train = parsed("worker")
    assert train.command == "train"
    # the mounted config, as run
    cfg = load_config(ROOT / resolved(str(train.config)), [resolved(o) for o in train.overrides])
    assert cfg.ams.scheduler == f"scheduler:{parsed('scheduler').port}"
    # a rollback exits the workers; torchrun must be allowed to start them again
    launch = torchrun_parser().parse_args([str(a) for a in SERVICES["worker"]["command"]])
    assert launch.max_restarts >= 1
    assert cfg.ams.token_file == "/run/secrets/ams_token"
    assert cfg.train.out_dir.startswith("/shared/")
    assert cfg.gear.redis_url.startswith("redis://redis:")
    for name in ("worker", "graph-build"):
        deps = SERVICES[name]["depends_on"]
        assert all(deps[s]["condition"] == "service_healthy" for s in SHARDS), name


def test_volumes_secrets_and_mounts_exist():
    named_volumes = set(COMPOSE["volumes"])
    secrets = set(COMPOSE["secrets"])
    for name, service in XCLS_ROLES.items():
        for mount in service.get("volumes", []):
            source, target = mount.split(":")[:2]
            if source.startswith("."):
                # bind mounts: the repo folder must exist and sit where relative config
                # paths resolve (the image's WORKDIR is /work)
                assert (ROOT / source).is_dir() or source == "./data", (name, mount)
                assert target == "/work/" + source[2:], (name, mount)
            else:
                assert source in named_volumes, (name, mount)
        assert set(service.get("secrets", [])) <= secrets, name
    assert all(s["file"].startswith("./") for s in COMPOSE["secrets"].values())


def test_dockerfile_installs_the_package_and_runs_xcls():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"import torch.*\n.*pip install .*torch", text)  # kept when the base has it
    # the dependencies are installed from pyproject.toml before the sources are copied
    deps = text.index("pip install -r /tmp/requirements.txt")
    for package in ("ams", "workers", "bridge", "xcls"):
        match = re.search(rf"^COPY {package} ", text, re.M)
        assert match and match.start() > deps, package
    # the package itself, with a C compiler for its compiled row update on a slim base
    install = re.search(r"^RUN if .*?\n(?:.*\\\n)*.*$", text, re.M)
    assert install and "gcc" in install.group(0), text
    assert install.group(0).count("pip install --no-deps .") == 2  # with or without apt
    assert 'ENTRYPOINT ["xcls"]' in text and re.search(r"^WORKDIR /work$", text, re.M)


def test_compose_files_match_the_compose_specification():
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                          "vendor.compose-spec", str(ROOT / "docker-compose.yml"),
                          str(ROOT / "docker-compose.gpu.yml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_shards_restart_and_get_time_to_restore():
    for name in [*SHARDS, "scheduler"]:
        assert SERVICES[name]["restart"] == "on-failure", name
    for name in SHARDS:
        assert SERVICES[name]["healthcheck"]["start_period"] == "120s", name


def test_gpu_variant_builds_on_cuda_and_reserves_the_gpus():
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    for name in ("worker", "graph-build"):
        assert name in SERVICES
        assert gpu[name]["build"]["args"]["BASE_IMAGE"].startswith("pytorch/pytorch:")
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert set(gpu) <= set(SERVICES)
