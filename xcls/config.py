"""Experiment configuration: one TOML file per experiment, read into the typed sections of
``workers.settings``.

Each field is checked as it is read, against its annotation: its type, its enum's members for a
choice (the field then holds the member), the constraints of ``workers.field_marks``. Unknown
keys, wrong types and refused values are errors in one line naming the dotted key, the value
and what is allowed; ``--set a.b=c`` overrides any field. What ties fields together is checked
last (``check_across_fields``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import textwrap
import tomllib
import types
import typing
import urllib.parse
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from ams.errors import clip, shorten
from workers.field_marks import OR_EMPTY, URL_PASSWORD_SECRET, Constraint
from workers.settings import ExperimentConfig, choice_enums


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the dotted key."""


# What a secret becomes wherever a config is written out (config.toml, exports, 'config print').
REDACTED = "***"
FLOAT32_MAX = 3.4028234663852886e38
# An experiment file is a few KiB; the bound keeps a wrong path (/dev/zero, a dataset) from
# being read whole.
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class FieldSpec:
    """A field as its annotation describes it. kind: the type of the value a file gives
    (``str`` for a choice, the section's dataclass for a section); choices: the enum a choice's
    value must be a member of (None: not a choice); marks: its ``workers.field_marks``."""

    kind: Any
    choices: type[StrEnum] | None
    marks: tuple[Any, ...]


@functools.cache
def field_specs(cls: type) -> dict[str, FieldSpec]:
    """Each field of the dataclass ``cls`` by name, in declaration order, as its annotation
    describes it."""
    hints = typing.get_type_hints(cls, localns=choice_enums(), include_extras=True)
    specs = {}
    for f in dataclasses.fields(cls):
        hint, marks = hints[f.name], ()
        if typing.get_origin(hint) is Annotated:
            hint, *marks = typing.get_args(hint)
        if isinstance(hint, type) and issubclass(hint, StrEnum):
            specs[f.name] = FieldSpec(str, hint, tuple(marks))
        else:
            specs[f.name] = FieldSpec(hint, None, tuple(marks))
    return specs


def _coerce(value: Any, kind: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``kind``; ints are accepted for floats."""
    origin = typing.get_origin(kind)
    if origin in (list, types.GenericAlias) or kind is list:
        (item,) = typing.get_args(kind) or (str,)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} "
                              f"{shorten(value)}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {shorten(value)}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {shorten(value)}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {shorten(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {shorten(value)}")
        if abs(value) > FLOAT32_MAX:  # every such setting ends up a factor in float32 math
            raise ConfigError(f"{key}: {shorten(value)} is beyond float32's range "
                              f"(|x| <= {FLOAT32_MAX:.6g})")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {shorten(value)}")
        return value
    raise ConfigError(f"{key}: unsupported field type {kind}")  # pragma: no cover


def _field_value(value: Any, spec: FieldSpec, key: str) -> Any:
    """``value`` for the field at ``key``, checked against ``spec``: of its type, one of its
    choices (the enum's member in its place), admitted by each of its constraints."""
    value = _coerce(value, spec.kind, key)
    if value == "" and OR_EMPTY in spec.marks:
        return value
    if spec.choices is not None:
        if value not in list(spec.choices):
            raise ConfigError(f"{key}: {shorten(value)} is not one of "
                              f"{', '.join(repr(str(m)) for m in spec.choices)}")
        value = spec.choices(value)
    for mark in spec.marks:
        if isinstance(mark, Constraint) and (problem := mark.problem(value)) is not None:
            raise ConfigError(f"{key}: {problem}, got {shorten(value)}")
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    """An instance of ``cls`` from the table ``data`` (at ``prefix``), every field checked,
    defaults included."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a table, got {shorten(data)}")
    specs = field_specs(cls)
    unknown = sorted(set(data) - set(specs))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {clip(where + unknown[0])} "
                          f"(known: {', '.join(sorted(specs))})")
    defaults = cls()
    values = {}
    for name, spec in specs.items():
        key = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(spec.kind):
            values[name] = _build(spec.kind, data.get(name, {}), key)
        else:
            values[name] = _field_value(data[name] if name in data else getattr(defaults, name),
                                        spec, key)
    return cls(**values)


def check_across_fields(cfg: ExperimentConfig) -> None:
    """What ties fields together; each field on its own was checked when it was read."""
    from bridge import GearBackend
    from workers.gear import SlowGearMode
    from workers.heads import HeadKind, Placement

    if cfg.graph.nlist and cfg.graph.nprobe > cfg.graph.nlist:
        raise ConfigError(f"graph.nprobe={cfg.graph.nprobe} exceeds graph.nlist="
                          f"{cfg.graph.nlist}: a class cannot scan more lists than there are")
    if cfg.head.kind == HeadKind.KNN and cfg.head.k > cfg.graph.k:
        raise ConfigError(f"head.k={cfg.head.k} exceeds graph.k={cfg.graph.k}: the graph must "
                          "keep at least as many neighbors as the head takes")
    if cfg.gear.slow == SlowGearMode.EXTERNAL and cfg.gear.backend != GearBackend.REDIS:
        raise ConfigError("gear.slow: 'external' slow gears read the Redis stream; set "
                          "gear.backend=redis")
    if cfg.ams.scheduler and cfg.ams.addresses:
        raise ConfigError("ams.scheduler: the shards come from the scheduler; leave "
                          "ams.addresses empty")
    if cfg.head.placement == Placement.COLLECTIVE:
        if cfg.ams.addresses or cfg.ams.scheduler:
            raise ConfigError("head.placement: 'collective' keeps the rows in the workers; "
                              "leave ams.addresses and ams.scheduler empty (or use "
                              "placement 'ams')")
        if cfg.gear.enabled:
            raise ConfigError("head.placement: gear mode trains with placement 'ams' only")
    # The decay clock takes log(1 - lr x decay) at every step, so the test is at the largest
    # rate any step reaches: the peak, scaled up by a growing batch's largest.
    scale = cfg.train.largest_batch_scale()
    lr = cfg.optim.effective_head_lr() * scale
    if lr * cfg.optim.head_weight_decay >= 1:
        scaled = f" (peak {lr / scale:g} x {scale:g}, the largest batch of " \
            "train.batch_schedule over its first)" if scale != 1 else ""
        raise ConfigError(f"optim.head_weight_decay: the class rows' lr {lr:g}{scaled} x "
                          f"head_weight_decay {cfg.optim.head_weight_decay:g} must be below 1")


def _parse_override(text: str, kind: Any, key: str) -> Any:
    """``--set`` value text -> a value of the field's type (TOML literal syntax accepted)."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):  # RecursionError: nested too deep
        value = text  # bare words are strings: --set head.kind=knn
    if kind is str and not isinstance(value, str):
        value = text
    if kind is bool and isinstance(value, str):
        value = {"true": True, "yes": True, "1": True, "false": False, "no": False,
                 "0": False}.get(value.lower(), value)
    if typing.get_origin(kind) is list and isinstance(value, str):
        # a,b,c: each item read as an override of the list's item type (64,96 -> [64, 96])
        (item,) = typing.get_args(kind)
        value = [_parse_override(v.strip(), item, f"{key}[{i}]")
                 for i, v in enumerate(v for v in value.split(",") if v)]
    return _coerce(value, kind, key)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=c`` overrides to the raw config dict (checked against the schema)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {shorten(item)}: expected KEY=VALUE, e.g. head.kind=knn")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        cls: Any = ExperimentConfig
        node = data
        for i, part in enumerate(parts):
            specs = field_specs(cls)
            key = ".".join(parts[:i + 1])
            if part not in specs:
                raise ConfigError(f"--set {clip(dotted)}: unknown key {clip(key)} "
                                  f"(known: {', '.join(sorted(specs))})")
            kind = specs[part].kind
            if dataclasses.is_dataclass(kind):
                if i == len(parts) - 1:
                    raise ConfigError(f"--set {clip(dotted)}: {key} is a section, name a field "
                                      "in it")
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{key}: expected a table")
                cls = kind
            else:
                if i != len(parts) - 1:
                    raise ConfigError(f"--set {clip(dotted)}: {key} is not a section")
                node[part] = _parse_override(text.strip(), kind, key)
    return data


def example_configs() -> list[Path]:
    """The example experiment configs installed with the package (``xcls/configs/*.toml``)."""
    return sorted((Path(__file__).parent / "configs").glob("*.toml"))


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a TOML experiment file (None: all defaults), apply overrides, check every field."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        try:
            with open(p, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"cannot read config {p}: {e.strerror}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config {p}: more than {MAX_CONFIG_BYTES} bytes, not an "
                              "experiment file")
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"config {p} is not UTF-8 text") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config {p} is not valid TOML: {e}") from None
        except RecursionError:
            raise ConfigError(f"config {p} is not valid TOML: nested too deep") from None
    data = apply_overrides(data, overrides or [])
    cfg = _build(ExperimentConfig, data, "")
    check_across_fields(cfg)
    return cfg


def to_toml(cfg: ExperimentConfig) -> str:
    """The full resolved config as TOML (every field, defaults included), each field under its
    documentation as comments; secrets are replaced by ``REDACTED``, as this text is what goes
    to disk (OUT/config.toml, exports) and to the terminal."""
    lines = []
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        docs = field_docs(type(part))
        lines.append(f"[{section.name}]")
        for name, spec in field_specs(type(part)).items():
            lines.extend(f"# {line}".rstrip() for line in docs.get(name, "").splitlines())
            value = getattr(part, name)
            if URL_PASSWORD_SECRET in spec.marks:
                value = redact_url_password(value)
            lines.append(f"{name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def redact_url_password(url: str) -> str:
    """``url`` with the password of its user info (``scheme://user:PASSWORD@host``) replaced by
    ``REDACTED``; unchanged when it has none; all of it replaced when it does not parse and
    holds an ``@``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return REDACTED if "@" in url else url
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if not (at and colon):
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{hostport}"))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation: the string literal written under it in the class body
    (the convention of ``workers.settings``), keyed by field name."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # installed without its sources: print the bare values
        return {}
    body = ast.parse(textwrap.dedent(source)).body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    # JSON's string escapes are TOML's (\n, \uXXXX, ...), but for DEL, which TOML escapes too
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
