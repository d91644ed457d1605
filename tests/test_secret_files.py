"""Secret files: a token or a password that no one could use is refused in one line, by the
shard, the scheduler, a worker's config and ``cluster up`` alike, before anything starts and
without showing the secret. Real processes for the commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workers.settings import GearConfig
from xcls.config import ConfigError, load_config
from xcls.run import create_client, redis_password
from xcls.secret_files import read_token

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# contents, what the error says, a part of the secret the error must not show
BAD_TOKENS = {
    "not UTF-8": (b"\xff\xfes3cret\n", "is not UTF-8 text (at byte 0)", "s3cret"),
    "a line break inside": (b"first\nsecond\n", "holds a line break at character 5", "second"),
    "not ASCII": ("s3crét\n".encode(), "holds a non-ASCII character at character 4", "s3cr"),
    "a control character": (b"s3\x01cret", "holds a control character at character 2", "cret"),
}


def bad_token_file(tmp_path, case):
    path = tmp_path / "token"
    path.write_bytes(BAD_TOKENS[case][0])
    return path


@pytest.mark.parametrize("case", BAD_TOKENS)
def test_a_token_no_client_could_send_is_refused_naming_the_file(tmp_path, case):
    path = bad_token_file(tmp_path, case)
    with pytest.raises(ConfigError) as info:
        read_token(path, "--auth-token-file")
    message = str(info.value)
    _, needle, secret = BAD_TOKENS[case]
    assert message.startswith(f"--auth-token-file: {path} ") and needle in message
    assert "\n" not in message and secret not in message


def test_a_token_file_is_read_as_one_line_of_printable_ascii(tmp_path):
    path = tmp_path / "token"
    path.write_bytes(b"  s3cret with spaces ~!\n\n")  # the whitespace around it is an editor's
    assert read_token(path, "ams.token_file") == "s3cret with spaces ~!"


@pytest.mark.parametrize("command", [["serve", "shard", "--shard-id", "0", "--num-shards", "1"],
                                     ["serve", "scheduler", "--num-shards", "1"]])
@pytest.mark.parametrize("case", ["not UTF-8", "a line break inside"])
def test_servers_refuse_a_bad_token_in_one_line_before_they_start(tmp_path, command, case):
    path = bad_token_file(tmp_path, case)
    out = subprocess.run([sys.executable, "-m", "xcls", *command, "--auth-token-file", str(path),
                          "--port-file", str(tmp_path / "port")],
                         capture_output=True, text=True, timeout=60)
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: --auth-token-file: {path} {BAD_TOKENS[case][1]}")
    assert not (tmp_path / "port").exists()  # it never listened


def test_a_worker_refuses_a_bad_token_before_it_connects(tmp_path):
    path = bad_token_file(tmp_path, "a line break inside")
    cfg = load_config(None, ["ams.addresses=127.0.0.1:1", f"ams.token_file={path}"])
    with pytest.raises(ConfigError, match=f"ams.token_file: {path} holds a line break"):
        create_client(cfg, tmp_path, 0, 1, lease=False)


def test_cluster_up_refuses_a_bad_token_before_anything_starts(tmp_path):
    path = bad_token_file(tmp_path, "not UTF-8")
    out = subprocess.run([sys.executable, "-m", "xcls", "cluster", "up",
                          str(CONFIGS / "glyphs-2k-knn.toml"), "--set", f"ams.token_file={path}",
                          "--data-dir", str(tmp_path / "ams")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"error: ams.token_file: {path} is not UTF-8 text (at byte 0)"]
    assert not (tmp_path / "ams").exists()


def test_a_redis_password_file_that_is_not_text_is_refused(tmp_path):
    path = tmp_path / "redis.password"
    path.write_bytes(b"\x80pass")
    with pytest.raises(ConfigError, match=f"gear.redis_password_file: {path} is not UTF-8"):
        redis_password(GearConfig(redis_password_file=str(path)), None)
    path.write_text("pässword\n")  # Redis takes any bytes: only the newline goes
    assert redis_password(GearConfig(redis_password_file=str(path)), None) == "pässword"
