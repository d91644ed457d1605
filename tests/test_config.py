"""Experiment configs: typed, strict, overridable; hostile files get a clear error."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from xcls.cli import main
from xcls.config import ConfigError, ExperimentConfig, load_config, to_toml


def write(tmp_path, text, name="exp.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_and_file_values(tmp_path):
    cfg = load_config(write(tmp_path, '[head]\nkind = "partial"\nsample_rate = 0.2\n'
                            '[ams]\naddresses = ["127.0.0.1:1", "127.0.0.1:2"]\n'))
    assert cfg.head.kind == "partial" and cfg.head.sample_rate == 0.2
    assert cfg.ams.addresses == ["127.0.0.1:1", "127.0.0.1:2"]
    assert cfg.model == ExperimentConfig().model


def test_int_accepted_for_float(tmp_path):
    assert load_config(write(tmp_path, "[optim]\nlr = 1\n")).optim.lr == 1.0


def test_overrides(tmp_path):
    assert load_config(None, ["train.amp=False"]).train.amp is False
    assert load_config(None, ["train.amp=yes"]).train.amp is True
    cfg = load_config(None, ["head.kind=full", "optim.lr=0.05", "train.amp=false",
                             "ams.addresses=127.0.0.1:7001,127.0.0.1:7002", "data.train=/x/y"])
    assert cfg.head.kind == "full" and cfg.optim.lr == 0.05 and cfg.train.amp is False
    assert cfg.ams.addresses == ["127.0.0.1:7001", "127.0.0.1:7002"]
    assert cfg.data.train == "/x/y"


@pytest.mark.parametrize("sets,rows_lr", [
    ([], 1.0),  # plain SGD rows take the backbone's steady-state step lr / (1 - momentum)
    (["optim.head_momentum=0.9"], 0.1),  # rows with the backbone's momentum take its lr
    (["optim.head_momentum=0.5", "optim.lr=0.2", "optim.momentum=0.8"], 0.5),
    (["optim.head_lr=0.3"], 0.3),  # an explicit rate wins
])
def test_class_rows_learning_rate(sets, rows_lr):
    assert load_config(None, sets).optim.effective_head_lr() == pytest.approx(rows_lr)


def test_comma_lists_take_the_type_of_their_items():
    assert load_config(None, ["train.batch_schedule=64,96"]).train.batch_schedule == [64, 96]
    assert load_config(None, ["train.batch_schedule=64, 96,"]).train.batch_schedule == [64, 96]
    assert load_config(None, ["data.verification=a,b"]).data.verification == ["a", "b"]


def test_row_decay_is_checked_at_the_largest_lr_a_growing_batch_reaches():
    """The trainer multiplies the rows' lr by each epoch's batch over the first's: at 8x the
    peak, lr 1 x decay 0.5 crosses 1 (the decay clock's log(1 - lr x decay) is undefined)."""
    sets = ["train.batch_schedule=[8,64]", "optim.head_weight_decay=0.5"]
    with pytest.raises(ConfigError, match=r"optim.head_weight_decay: the class rows' lr 8 "
                       r"\(peak 1 x 8, the largest batch of train.batch_schedule over its "
                       r"first\) x head_weight_decay 0.5 must be below 1"):
        load_config(None, [*sets, "train.epochs=2"])
    # the epoch of the larger batch is never reached, or the rates do not follow the batch
    assert load_config(None, [*sets, "train.epochs=1"]).train.batch_schedule == [8, 64]
    assert load_config(None, [*sets, "train.epochs=2", "train.batch_lr_scaling=false"])


@pytest.mark.parametrize("override,needle", [
    ("train.batch_schedule=[8,64]", "optim.head_weight_decay: the class rows' lr 8"),
    ("model.dim=100000", "model.dim: must be at most 65536"),
    ("gear.ttl=1e30", "gear.ttl: must be at most"),
    ("train.out_dir=", "train.out_dir: must name the run's directory"),
])
def test_cli_refuses_in_one_line_naming_the_key(override, needle, capsys):
    sets = ["train.epochs=2", "optim.head_weight_decay=0.5", override]
    assert main(["config", "print", *sum((["--set", s] for s in sets), [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {needle}") and err.count("\n") == 1, err


def test_print_round_trips(tmp_path):
    cfg = load_config(None, ["head.kind=partial", "ams.addresses=a:1"])
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg
    assert tomllib.loads(to_toml(cfg))["head"]["kind"] == "partial"


@pytest.mark.parametrize("path", ["/tmp/run\nnext", "tab\there", 'a "quoted" \\ path',
                                  "bell\x07del\x7f", "漢字/é"])
def test_print_round_trips_strings_toml_must_escape(tmp_path, path):
    cfg = load_config(None, [f"train.out_dir={path}"])
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert str(again.train.out_dir) == path


def test_print_documents_each_field_above_it():
    lines = to_toml(load_config(None, [])).splitlines()
    at = lines.index("rebuild_every = 0")
    doc = []
    for line in reversed(lines[:at]):
        if not line.startswith("# "):
            break
        doc.insert(0, line[2:])
    assert " ".join(doc).startswith("steps between graph rebuilds, >= 0 (0: once per epoch).")
    assert lines[lines.index("[graph]") + 1].startswith("# neighbors kept per class")


@pytest.mark.parametrize("text,needle", [
    ("[head]\nkindd = 'knn'\n", "unknown key head.kindd"),
    ("[headz]\nkind = 'knn'\n", "unknown key headz"),
    ("[head]\nkind = 3\n", "head.kind: expected a string"),
    ("[head]\nkind = 'softer'\n", "head.kind: 'softer' is not one of"),
    ("[data]\nbatch_size = 'big'\n", "data.batch_size: expected an integer"),
    ("[data]\nbatch_size = 0\n", "data.batch_size: must be > 0"),
    ("[data]\nbatch_size = 2.5\n", "data.batch_size: expected an integer"),
    ("[train]\namp = 1\n", "train.amp: expected true or false"),
    ("[ams]\nshared_memory = \"no\"\n", "ams.shared_memory: expected true or false"),
    ("[optim]\nlr = -0.1\n", "optim.lr: must be >= 0"),
    ("[optim]\nlr = nan\n", "optim.lr: expected a finite number"),
    ("[optim]\nlr = 1e39\n", "optim.lr: 1e+39 is beyond float32's range"),
    ("[train]\nthreads = 100000\n", "train.threads: must be at most 1024, got 100000"),
    ("[head]\nscale = -1e300\n", "head.scale: -1e+300 is beyond float32's range"),
    ("[optim]\nmomentum = 1.5\n", "optim.momentum"),
    ("[optim]\nhead_momentum = 1\n", "optim.head_momentum: must be in [0, 1)"),
    ("[optim]\nhead_momentum = -0.5\n", "optim.head_momentum: must be in [0, 1)"),
    ("[optim]\nhead_weight_decay = 1.0\n", "the class rows' lr 1 x head_weight_decay 1 must"),
    ("[optim]\nhead_weight_decay = -1e-4\n", "optim.head_weight_decay: must be >= 0"),
    ("[head]\nsample_rate = 0\n", "head.sample_rate"),
    ("[head]\nrandom_share = 1.5\n", "head.random_share"),
    ("[head]\nk = 64\n[graph]\nk = 32\n", "head.k=64 exceeds graph.k=32"),
    ("[graph]\nmethod = 'annoy'\n", "graph.method: 'annoy' is not one of 'exact', 'ivf'"),
    ("[graph]\nrefresh = 'some'\n", "graph.refresh: 'some' is not one of 'full', 'touched'"),
    ("[graph]\nnprobe = 0\n", "graph.nprobe: must be > 0"),
    ("[graph]\nnlist = -1\n", "graph.nlist: must be >= 0"),
    ("[graph]\nnlist = 4\nnprobe = 8\n", "graph.nprobe=8 exceeds graph.nlist=4"),
    ("[graph]\nfull_every = -1\n", "graph.full_every: must be >= 0"),
    ("[ams]\naddresses = '127.0.0.1:1'\n", "ams.addresses: expected a list"),
    ("[ams]\naddresses = [1]\n", "ams.addresses[0]: expected a string"),
    ("[ams]\nstorage = 'disk'\n", "ams.storage: 'disk' is not one of 'memory', 'mmap'"),
    ("[comm]\ncompression = 'zip'\n", "comm.compression: 'zip' is not one of 'none', 'topk'"),
    ("[comm]\ndensity = 0\n", "comm.density: must be in (0, 1], got 0"),
    ("[comm]\ndensity = 1.5\n", "comm.density: must be in (0, 1], got 1.5"),
    ("[comm]\nwarmup_steps = -1\n", "comm.warmup_steps: must be >= 0"),
    ("[comm]\ndense_below = 'small'\n", "comm.dense_below: expected an integer"),
    ("head = 3\n", "head: expected a table"),
    ("[head\nkind = 'knn'\n", "not valid TOML"),
    pytest.param("v = " + "[" * 100_000, "not valid TOML: nested too deep", id="too-deep"),
])
def test_hostile_files(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(write(tmp_path, text))
    assert needle in str(info.value)


@pytest.mark.parametrize("override,needle", [
    ("head.kindx=knn", "unknown key head.kindx"),
    ("head=knn", "is a section"),
    ("head.kind.x=1", "not a section"),
    ("optim.lr=fast", "optim.lr: expected a number"),
    ("nokey", "expected KEY=VALUE"),
    ("train.batch_schedule=[64, 0]", "train.batch_schedule: every batch must be > 0"),
    ("train.batch_schedule=64", "train.batch_schedule: expected a list"),
    ("train.batch_schedule=[64, 1.5]", "expected an integer"),
    ("train.batch_schedule=64,x", "train.batch_schedule[1]: expected an integer, got 'x'"),
    ("model.dim=100000", "model.dim: must be at most 65536, got 100000"),
    ("gear.ttl=1e30", "gear.ttl: must be at most 1000000000, got 1e+30"),
    ("train.out_dir=", "train.out_dir: must name the run's directory"),
    ("head.placement=ps", "head.placement: 'ps' is not one of"),
    ("optim.name=adam", "optim.name: 'adam' is not one of"),
    pytest.param("train.max_steps=" + "[" * 100_000, "train.max_steps: expected an integer",
                 id="too-deep"),
])
def test_hostile_overrides(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


HUGE = "x" * 100_000


@pytest.mark.parametrize("override,file_text,needle", [
    pytest.param(f"head.kind={HUGE}", None, "head.kind: 'xxx", id="set-value"),
    pytest.param(f"{HUGE}=1", None, "unknown key xxx", id="set-section"),
    pytest.param(f"head.{HUGE}=1", None, "unknown key head.xxx", id="set-key"),
    pytest.param(HUGE, None, "expected KEY=VALUE", id="set-no-equals"),
    pytest.param("train.batch_schedule=[" + ",".join(["-1"] * 20_000) + "]", None,
                 "every batch must be > 0, got [-1, -1", id="set-list"),
    pytest.param(None, f"[head]\n{HUGE} = 1\n", "unknown key head.xxx", id="file-key"),
    pytest.param(None, f"[gear]\nprefix = '{HUGE}:'\n", "gear.prefix", id="file-prefix"),
    pytest.param(None, f"[ams]\nscheduler = '{HUGE}'\n", "ams.scheduler: expected host:port",
                 id="file-scheduler"),
])
def test_errors_quote_a_huge_value_shortened(tmp_path, override, file_text, needle):
    """A value of 100,000 characters is named by its start and its length, not echoed whole
    into the terminal or the log."""
    path = write(tmp_path, file_text) if file_text is not None else None
    with pytest.raises(ConfigError) as info:
        load_config(path, [override] if override is not None else [])
    message = str(info.value)
    assert needle in message
    assert len(message) < 600 and "chars)" in message


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bin.toml"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)
    # a path to something that is not an experiment file is not read whole
    with pytest.raises(ConfigError, match="more than 1048576 bytes, not an experiment file"):
        load_config("/dev/zero")
    assert load_config("/dev/null") == load_config(None)


def test_cli_config_print_and_errors(tmp_path, capsys):
    out = subprocess.run([sys.executable, "-m", "xcls", "config", "print", "--set",
                          "head.kind=partial"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and 'kind = "partial"' in out.stdout
    # the refusals: the command in this process
    assert main(["train", str(write(tmp_path, "[model]\ndim = -3\n"))]) == 2
    err = capsys.readouterr().err
    assert "model.dim: must be > 0" in err and "Traceback" not in err
    assert main(["train", str(write(tmp_path, ""))]) == 2
    assert "data.train" in capsys.readouterr().err


@pytest.mark.parametrize("url,written,secret", [
    ("redis://:s3cret-Zq81@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0", "s3cret-Zq81"),
    ("redis://alice:Pw-9x7@cache.example:6380", "redis://alice:***@cache.example:6380",
     "Pw-9x7"),
    ("redis://:p%40ss%3Aw0rd@h:1/2", "redis://:***@h:1/2", "p%40ss%3Aw0rd"),
])
def test_written_config_hides_url_passwords(tmp_path, url, written, secret):
    cfg = load_config(None, [f"gear.redis_url={url}"])
    assert cfg.gear.redis_url == url  # the run itself keeps the password
    text = to_toml(cfg)
    assert secret not in text and "p@ss:w0rd" not in text
    assert tomllib.loads(text)["gear"]["redis_url"] == written
    assert load_config(write(tmp_path, text)).gear.redis_url == written


def test_written_config_keeps_urls_without_password(tmp_path):
    cfg = load_config(None, ["gear.redis_url=redis://alice@127.0.0.1:6379/3"])
    assert tomllib.loads(to_toml(cfg))["gear"]["redis_url"] == "redis://alice@127.0.0.1:6379/3"


def test_collective_placement_refuses_shards_and_gear():
    with pytest.raises(ConfigError, match="leave ams.addresses and ams.scheduler empty"):
        load_config(None, ["head.placement=collective", "ams.addresses=[\"h:1\"]"])
    with pytest.raises(ConfigError, match="gear mode trains with placement 'ams' only"):
        load_config(None, ["head.placement=collective", "gear.enabled=true"])
