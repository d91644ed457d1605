"""Deployment: classify by the nearest class row (as KNN softmax deploys its model), and the
export format.

An export directory holds everything needed to classify without the AMS:

    export.json          format, backbone name, dim, image size, channels, classes, step
    backbone.safetensors backbone weights
    backbone.onnx        (``--onnx``) the backbone for ONNX runtimes: uint8 images in,
                         float32 features out
    rows.npy             (num_classes, dim) class rows (float16 or float32; memory-mapped):
                         the trained rows, or the training features' class means
    classes.json         class id -> name (e.g. "U+4E00"); null where class i is named "i"
    config.toml          the experiment config it was trained with, secrets redacted
"""

from __future__ import annotations

import copy
import json
import shutil
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch import nn

from ams.graph.topk import merge_top_lists, resolve_device
from ams.jsontext import parse_json
from ams.limits import MAX_DIM
from ams.shard.optim import all_finite
from workers.backbones import Backbone, build_backbone
from workers.data.class_names import NumberedClasses, class_names_from_json, class_names_to_json

EXPORT_FORMAT = "xcls-export"
EXPORT_VERSION = 1


def images_to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, C, H, W] -> float32 in [-1, 1], the backbone's input (one definition, shared
    by training, evaluation and prediction)."""
    return images.float().div_(127.5).sub_(1.0)


# float32 scores one step of nearest_classes holds (64 MiB): a test set against a block of rows
# in chunks of features, never n x N at once
MAX_SCORES = 1 << 24
# class rows Classifier.predict normalizes and scores at a time (32 MiB of float32 at d = 128)
PREDICT_BLOCK_ROWS = 65536


def nearest_classes(features: torch.Tensor, blocks: Iterable[tuple[torch.Tensor, torch.Tensor]],
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k classes of each feature by cosine to the class rows, streaming the rows.

    features: (n, d) float; blocks: (class ids int64 (b,), rows (b, d)) covering the classes.
    Returns (ids int64 (n, k), cosines float32 (n, k)), best first (-1 / -inf pads k > N).
    Memory is bounded by ``MAX_SCORES`` float32 scores (64 MiB) per step, never by n x N: the
    features are taken in chunks against each block, and each chunk's block top-k is merged
    into the running lists (a whole test set against every row at once would take n x N).
    """
    q = F.normalize(features.float(), dim=1)
    n = q.shape[0]
    best_scores = torch.full((n, k), -torch.inf)
    best_ids = torch.full((n, k), -1, dtype=torch.int64)
    for ids, rows in blocks:
        if ids.numel() == 0:
            continue
        keys = F.normalize(rows.to(q.device).float(), dim=1)
        width = min(k, keys.shape[0])
        chunk = max(1, MAX_SCORES // keys.shape[0])
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            top_scores, cols = (q[start:stop] @ keys.t()).topk(width, dim=1)
            best_ids[start:stop], best_scores[start:stop] = merge_top_lists(
                best_ids[start:stop], best_scores[start:stop], ids[cols.cpu()], top_scores.cpu())
    return best_ids, best_scores


ROW_SOURCES = ("trained", "class-means")
ROW_DTYPES = ("float32", "float16")


def class_means(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], num_classes: int,
                dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each class's mean direction: the normalized sum of its normalized features.

    batches: (features (b, dim) float, labels (b,) int64 in 0..num_classes-1).
    Returns (means float32 (num_classes, dim), unit length, zero for a class with no feature;
    counts int64 (num_classes,)). The sums are float64: num_classes x dim x 8 bytes.

    Used as class rows ("class-means"), they classify by the backbone alone, free of the
    trained rows' convergence (docs/accuracy.md compares the two).
    """
    sums = torch.zeros(num_classes, dim, dtype=torch.float64)
    counts = torch.zeros(num_classes, dtype=torch.int64)
    for features, labels in batches:
        if features.dim() != 2 or features.shape[1] != dim or labels.shape != features.shape[:1]:
            raise ValueError(f"class_means: features {tuple(features.shape)} and labels "
                             f"{tuple(labels.shape)} do not pair as (b, {dim}) and (b,)")
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
            raise ValueError(f"class_means: labels must lie in 0..{num_classes - 1}")
        sums.index_add_(0, labels, F.normalize(features.double(), dim=1))
        counts += torch.bincount(labels, minlength=num_classes)
    return F.normalize(sums, dim=1).float(), counts


class _FromImages(nn.Module):
    """The backbone as a deployed model sees it: uint8 images in, embeddings out."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images_to_input(images))


def export_onnx(backbone: Backbone, image_size: int, channels: int, path: Path) -> None:
    """Write the backbone as an ONNX model: input ``images`` uint8 (N, channels, image_size,
    image_size), any N; output ``features`` float32 (N, dim), not normalized (cosine against
    rows.npy classifies). Needs the packages of the ``onnx`` extra (torch's exporter imports
    onnxscript). A backbone on a GPU is exported from a CPU copy: the example input is on the
    CPU, and the file must not depend on the device it was written from."""
    model = _FromImages(copy.deepcopy(backbone).cpu()).eval()
    example = torch.zeros(2, channels, image_size, image_size, dtype=torch.uint8)
    with warnings.catch_warnings():
        # the exporter's own deprecations (torch calling its older APIs), nothing a user of
        # xcls export can act on
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (example,), str(path), dynamo=True, input_names=["images"],
                          output_names=["features"],
                          dynamic_shapes={"images": {0: torch.export.Dim("batch")}})


def write_export(out: Path, backbone: Backbone, rows_blocks: Iterable[tuple[torch.Tensor,
                 torch.Tensor]], *, backbone_name: str, num_classes: int, dim: int,
                 image_size: int, channels: int, class_names: list[str] | NumberedClasses,
                 step: int, config_toml: str, row_source: str = "trained",
                 rows_dtype: str = "float32", onnx: bool = False) -> Path:
    """Write an export directory (see the module docstring) from a trained backbone and the
    class rows streamed as (ids, rows) blocks; ``row_source`` (one of ``ROW_SOURCES``) says
    what the rows are and is recorded in export.json. ``rows_dtype`` "float16" stores the rows
    L2-normalized in half the bytes (classification is by cosine, so nothing else changes).
    ``onnx``: also ``backbone.onnx`` (``export_onnx``). ``config_toml`` is written as given:
    the caller redacts its secrets (``xcls.config.to_toml`` does), an export being shared.

    The files are written into a new directory beside ``out``, which then takes the place of
    ``out``: an export that fails half way (a full disk, a bad row block) leaves no partial
    directory and an older export at ``out`` whole. ``out`` may be missing, empty or an
    export; anything else is refused (``ValueError``), as replacing it would delete it."""
    if rows_dtype not in ROW_DTYPES:
        raise ValueError(f"rows_dtype {rows_dtype!r}: one of {ROW_DTYPES}")
    out = Path(out)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir())
                                               or (out / "export.json").is_file())):
        raise ValueError(f"{out}: exists and is not an xcls export; name a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        _write_export_files(staging, backbone, rows_blocks, num_classes=num_classes, dim=dim,
                            image_size=image_size, channels=channels, onnx=onnx,
                            rows_dtype=rows_dtype)
        (staging / "classes.json").write_text(
            json.dumps(class_names_to_json(class_names), ensure_ascii=False))
        (staging / "config.toml").write_text(config_toml)
        (staging / "export.json").write_text(json.dumps({
            "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "backbone": backbone_name,
            "dim": dim, "image_size": image_size, "channels": channels,
            "num_classes": num_classes, "step": step, "rows": row_source,
            "onnx": "backbone.onnx" if onnx else None,
        }, indent=1))
        old = out.with_name(f"{staging.name}.old")
        if out.exists():
            out.rename(old)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out


def _write_export_files(out: Path, backbone: Backbone,
                        rows_blocks: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                        num_classes: int, dim: int, image_size: int, channels: int,
                        onnx: bool, rows_dtype: str) -> None:
    """The backbone's files and rows.npy of ``write_export``, in ``out``."""
    state = {k: v.detach().cpu().contiguous() for k, v in backbone.state_dict().items()}
    # written as any file is (mode 0666 less the umask): safetensors' save_file makes it 0600,
    # which other users of a shared model directory cannot read
    (out / "backbone.safetensors").write_bytes(save(state))
    if onnx:
        export_onnx(backbone, image_size, channels, out / "backbone.onnx")
    rows = np.lib.format.open_memmap(out / "rows.npy", mode="w+", dtype=np.dtype(rows_dtype),
                                     shape=(num_classes, dim))
    seen = 0
    for ids, block in rows_blocks:
        block = block.float()
        if rows_dtype == "float16":
            block = F.normalize(block, dim=1)  # unit rows: fp16 keeps ~3 digits of each
        rows[ids.numpy()] = block.numpy().astype(rows_dtype)
        seen += ids.numel()
    rows.flush()
    del rows
    if seen != num_classes:
        raise ValueError(f"the row blocks covered {seen} rows, expected {num_classes}")


# export.json's fields a reader needs, with their types (positive integers but the backbone)
_EXPORT_FIELDS = {"backbone": str, "dim": int, "image_size": int, "channels": int,
                  "num_classes": int}


def read_export_meta(path: Path) -> dict:
    """export.json of the export directory ``path``, checked: this format and version, and
    the fields a reader needs, with their types (``_EXPORT_FIELDS``). ValueError naming the
    file and the field otherwise."""
    where = path / "export.json"
    try:
        meta = parse_json(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not an xcls export (export.json: {e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: not an xcls export (a JSON object is due)")
    if meta.get("format") != EXPORT_FORMAT or meta.get("version") != EXPORT_VERSION:
        raise ValueError(f"{path}: export format {meta.get('format')!r} v"
                         f"{meta.get('version')!r}, this build reads {EXPORT_FORMAT} v"
                         f"{EXPORT_VERSION}")
    for field, kind in _EXPORT_FIELDS.items():
        value = meta.get(field)
        if (not isinstance(value, kind) or isinstance(value, bool)
                or (kind is int and value < 1)):
            raise ValueError(f"{where}: {field} must be a "
                             f"{'positive integer' if kind is int else 'string'}, got "
                             f"{value!r}")
    if meta["channels"] not in (1, 3):
        raise ValueError(f"{where}: channels must be 1 or 3, got {meta['channels']}")
    if meta["dim"] > MAX_DIM:  # no table has wider rows; the backbone is built at this width
        raise ValueError(f"{where}: dim must be at most {MAX_DIM}, got {meta['dim']}")
    return meta


def _finite_rows(rows: torch.Tensor, start: int) -> torch.Tensor:
    """``rows`` (b, dim), the export's rows from ``start`` on, unless one holds a NaN or an
    infinity: such a row would score NaN, which ``topk`` ranks first for every image."""
    if not all_finite(rows):
        bad = start + int((~torch.isfinite(rows).all(dim=1)).nonzero()[0, 0])
        raise ValueError(f"rows.npy: class row {bad} holds a non-finite value (a damaged "
                         "export)")
    return rows


class Classifier:
    """A trained model from an export directory: images -> top-k classes by nearest row."""

    def __init__(self, backbone: Backbone, rows: torch.Tensor,
                 class_names: list[str] | NumberedClasses,
                 image_size: int, channels: int, device: str = "cpu") -> None:
        """``rows`` (num_classes, dim) float32 or float16, on the CPU (may be memory-mapped):
        scored block by block on ``device``."""
        self.backbone = backbone.to(device).eval()
        self.rows = rows
        self.class_names = class_names
        self.image_size = image_size
        self.channels = channels
        self.device = device

    @classmethod
    def load(cls, path: str | Path, device: str = "auto") -> Classifier:
        """Open an export directory written by ``xcls export``. The class rows stay
        memory-mapped (pages are read as the search reaches them); the backbone and the search
        run on ``device`` ("auto": CUDA when there is one). A directory that is not a
        complete export of this format raises ``ValueError`` (or ``OSError``) naming the
        file."""
        device = str(resolve_device(None if device == "auto" else device))
        path = Path(path)
        meta = read_export_meta(path)
        # the rows first: a mapping reads nothing, and the width they have is the one the
        # backbone is built at (export.json alone could ask for any)
        try:  # copy-on-write mapping: a writable array for torch, nothing read until used
            rows = np.load(path / "rows.npy", mmap_mode="c")
        except ValueError as e:  # truncated, or not an array numpy can map
            raise ValueError(f"{path / 'rows.npy'}: not a row array ({e})") from None
        if (rows.dtype.name not in ROW_DTYPES or not rows.dtype.isnative
                or rows.shape != (meta["num_classes"], meta["dim"])):
            raise ValueError(f"{path / 'rows.npy'}: {rows.dtype.str} {rows.shape}, the export "
                             f"holds rows of shape ({meta['num_classes']}, {meta['dim']}) in "
                             f"one of {ROW_DTYPES}, native byte order")
        backbone = build_backbone(meta["backbone"], meta["dim"], meta["channels"],
                                  meta["image_size"])
        try:
            backbone.load_state_dict(load_file(str(path / "backbone.safetensors")))
        except (SafetensorError, RuntimeError) as e:  # torch lists every mismatch on a line
            raise ValueError(f"{path / 'backbone.safetensors'}: not the weights of a "
                             f"{meta['backbone']} of dim {meta['dim']} and {meta['channels']} "
                             f"channels ({str(e).strip().splitlines()[-1].strip()})") from None
        try:
            names = class_names_from_json(
                parse_json((path / "classes.json").read_text(encoding="utf-8")),
                meta["num_classes"])
        except ValueError as e:  # not UTF-8, not JSON, not a list of names nor null
            raise ValueError(f"{path / 'classes.json'}: {e}") from None
        return cls(backbone, torch.from_numpy(rows), names, meta["image_size"],
                   meta["channels"], device)

    def _check_images(self, images: torch.Tensor | np.ndarray) -> torch.Tensor:
        t = torch.as_tensor(images)
        if t.dtype != torch.uint8:
            raise ValueError(f"images must be uint8, got {t.dtype}")
        if t.dim() == 3 and self.channels == 1:
            t = t[:, None]
        expected = (self.channels, self.image_size, self.image_size)
        if t.dim() != 4 or tuple(t.shape[1:]) != expected:
            raise ValueError(f"images must be [N, H, W] (grayscale) or [N, C, H, W] with "
                             f"(C, H, W) = {expected}, got {tuple(t.shape)}")
        return t

    @torch.no_grad()
    def embed(self, images: torch.Tensor | np.ndarray, batch_size: int = 512) -> torch.Tensor:
        """uint8 images -> (N, dim) float32 features."""
        t = self._check_images(images)
        out = [self.backbone(images_to_input(t[i:i + batch_size]).to(self.device)).float().cpu()
               for i in range(0, t.shape[0], batch_size)]
        return torch.cat(out) if out else torch.empty((0, self.rows.shape[1]))

    def predict(self, images: torch.Tensor | np.ndarray, topk: int = 5, batch_size: int = 512
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k class ids int64 (N, topk) and cosine scores float32 (N, topk), best first;
        the backbone takes ``batch_size`` images per forward pass (``xcls predict
        --batch-size``)."""
        features = self.embed(images, batch_size)
        n, block = self.rows.shape[0], PREDICT_BLOCK_ROWS
        blocks = ((torch.arange(s, min(s + block, n)), _finite_rows(self.rows[s:s + block], s))
                  for s in range(0, n, block))
        return nearest_classes(features.to(self.device), blocks, min(topk, n))

    def names(self, ids: torch.Tensor) -> list[list[str]]:
        """Class names of predicted ids (N, k)."""
        return [[self.class_names[i] for i in row] for row in ids.tolist()]
