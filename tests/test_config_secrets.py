"""A Redis password reaches Redis but never the disk: a run's config.toml, its checkpoints and
its exports hold none of it, and a run resumed from the written config is told where to give it.
Real Redis (with ``requirepass``), real glyph data."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import redis

from xcls.config import ConfigError, load_config
from xcls.run import build_run
from xcls.train_cmd import run_export

PASSWORD = "s3cret-Zq81"


def files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def run_sets(data: Path, out: Path, url: str) -> list[str]:
    sets = {"data.train": data / "train", "data.test": "", "data.batch_size": 64,
            "data.num_workers": 0, "model.dim": 32, "head.kind": "full",
            "train.out_dir": out, "train.threads": 2, "train.max_steps": 2,
            "gear.enabled": "true", "gear.backend": "redis", "gear.prefix": "secrets",
            "gear.redis_url": url}
    return [f"{k}={v}" for k, v in sets.items()]


def test_redis_password_stays_off_disk_and_a_resume_asks_for_it(glyphs_small, tmp_path,
                                                                  own_redis):
    with redis.Redis(host=own_redis.host, port=own_redis.port) as admin:
        admin.config_set("requirepass", PASSWORD)
    out = tmp_path / "run"
    url = f"redis://:{PASSWORD}@{own_redis.host}:{own_redis.port}/0"
    sets = run_sets(glyphs_small, out, url)
    run = build_run(load_config(None, sets))
    assert run.trainer.train().steps == 2
    acc = run.trainer.gear.accumulator
    assert acc.metrics.added == 2 * 64 and acc.metrics.fallback == 0  # Redis took them all
    assert "redis://:***@" in (out / "config.toml").read_text()
    assert files_holding(out, PASSWORD) == []

    export = tmp_path / "export"
    run_export(argparse.Namespace(config=None, overrides=sets, out=export, rows="trained",
                                  rows_dtype="float32", onnx=False))
    assert (export / "config.toml").exists() and files_holding(export, PASSWORD) == []

    # The written config has no password: resuming from it says how to give one ...
    more = ["train.max_steps=4"]
    with pytest.raises(ConfigError, match="gear.redis_password_file"):
        build_run(load_config(out / "config.toml", more))
    # ... and with it in a file the run authenticates and goes on.
    secret = tmp_path / "redis.password"
    secret.write_text(PASSWORD + "\n")
    resumed = build_run(load_config(out / "config.toml",
                                    [*more, f"gear.redis_password_file={secret}"]))
    assert resumed.trainer.train().steps == 4
    acc = resumed.trainer.gear.accumulator
    assert acc.metrics.added == 2 * 64 and acc.metrics.fallback == 0
    assert files_holding(out, PASSWORD) == []


def test_password_in_url_and_file_at_once_is_refused(glyphs_small, tmp_path, own_redis):
    secret = tmp_path / "redis.password"
    secret.write_text(PASSWORD)
    url = f"redis://:{PASSWORD}@{own_redis.host}:{own_redis.port}/0"
    cfg = load_config(None, [*run_sets(glyphs_small, tmp_path / "run", url),
                             f"gear.redis_password_file={secret}"])
    with pytest.raises(ConfigError, match="in one place"):
        build_run(cfg)
