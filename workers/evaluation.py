"""Evaluation and row export helpers of a training run: embed a split with the backbone,
produce the class rows (as trained, or each class's mean training feature) and score top-1 /
top-5 by nearest class row."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from workers.batch_plan import collate
from workers.predict import ROW_SOURCES, class_means, images_to_input, nearest_classes
from workers.verification import kfold_accuracy, pair_scores


class RowScanner(Protocol):
    """The part of the AMS client API evaluation reads (``ams.connect(...)`` satisfies it)."""

    def scan(self, table: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row of ``table`` as (ids int64 (b,), rows (b, dim)) blocks."""
        ...


class Evaluator:
    """Scores a run's backbone and class rows.

    client: the AMS client holding ``table``; backbone: the embedding network (not
    DDP-wrapped); train_set / test_set: ``dataset[i]`` -> (id, uint8 image (C, H, W), label);
    pair_sets: name -> pair dataset (``xcls data bin``: samples 2i and 2i+1 are pair i, both
    labelled 1 for the same identity, 0 for different ones), scored by ``verify``;
    verify_flipped: a pair image's embedding is the sum of its own and its mirror image's
    (insightface's test-time flip; for models trained with ``data.flip``); amp: embed under
    autocast (CUDA); show_progress: draw a progress bar while embedding.
    """

    def __init__(self, client: RowScanner, table: str, backbone: nn.Module, device: torch.device,
                 *, num_classes: int, dim: int, train_set: Dataset, test_set: Dataset | None,
                 pair_sets: dict[str, Dataset] | None = None, verify_flipped: bool = False,
                 amp: bool = False, show_progress: bool = False) -> None:
        self.client, self.table = client, table
        self.backbone, self.device = backbone, device
        self.num_classes, self.dim = num_classes, dim
        self.train_set, self.test_set = train_set, test_set
        self.pair_sets = dict(pair_sets or {})
        self.verify_flipped = verify_flipped
        self.amp, self.show_progress = amp, show_progress

    @torch.no_grad()
    def embed(self, dataset: Dataset, flipped: bool = False
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(features float32 (b, dim) on CPU, labels int64 (b,)) batches of ``dataset`` in id
        order, embedded in eval mode (the backbone's mode is restored after); ``flipped``: each
        feature is the sum of the image's and its left-right mirror's."""
        was_training = self.backbone.training
        self.backbone.eval()
        # Loaded in this process: worker processes forked here would inherit the training
        # loader's live iterator, whose finaliser then fails noisily in the child.
        loader = DataLoader(dataset, batch_size=512, num_workers=0, collate_fn=collate)
        try:
            bar = tqdm(loader, desc="embedding", leave=False, dynamic_ncols=True,
                       disable=not (self.show_progress and sys.stderr.isatty()))
            for _, images, labels in bar:
                inputs = images_to_input(images.to(self.device))
                with torch.autocast(self.device.type, enabled=self.amp):
                    features = self.backbone(inputs)
                    if flipped:
                        features = features.float() + self.backbone(inputs.flip(-1)).float()
                yield features.float().cpu(), labels
        finally:
            self.backbone.train(was_training)

    def row_blocks(self, source: str = "trained") -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """The class rows as (ids int64 (b,), rows (b, dim)) blocks covering every class.

        ``"trained"``: the AMS table as trained. ``"class-means"``: each class's mean
        direction over the training split (``workers.predict.class_means``), one pass of the
        backbone over it; a class with no training image keeps its trained row.
        """
        if source not in ROW_SOURCES:
            raise ValueError(f"row source must be one of {ROW_SOURCES}, got {source!r}")
        if source == "trained":
            return self.client.scan(self.table)
        means, counts = class_means(self.embed(self.train_set), self.num_classes, self.dim)
        return ((ids, torch.where((counts[ids] > 0)[:, None], means[ids], rows.float()))
                for ids, rows in self.client.scan(self.table))

    def evaluate(self, rows: str = "trained") -> dict:
        """``{"top1", "top5", "samples"}`` of the test split by nearest class row (empty
        without a test split); ``rows``: the row source, as in :meth:`row_blocks`."""
        if self.test_set is None:
            return {}
        batches = list(self.embed(self.test_set))
        features = torch.cat([f for f, _ in batches])
        labels = torch.cat([y for _, y in batches])
        ids, _ = nearest_classes(features, self.row_blocks(rows), 5)
        hits = ids == labels[:, None]
        return {"top1": float(hits[:, 0].float().mean()),
                "top5": float(hits.any(1).float().mean()), "samples": int(labels.numel())}

    def verify(self) -> dict:
        """``{"verify_<name>": accuracy, "verify_<name>_std": ...}`` of each pair set: the
        10-fold accuracy at the best cosine threshold (``workers.verification``), with the
        mirror images' embeddings added when ``verify_flipped``."""
        scores = {}
        for name, pairs in self.pair_sets.items():
            batches = list(self.embed(pairs, flipped=self.verify_flipped))
            features = torch.cat([f for f, _ in batches])
            flags = torch.cat([y for _, y in batches])
            mean, std = kfold_accuracy(pair_scores(features), flags[0::2] == 1)
            scores[f"verify_{name}"], scores[f"verify_{name}_std"] = mean, std
        return scores
