"""Trace the first steps of an accuracy-study run: what the loss, the class rows and the active
set do while a run finds (or misses) its footing.

    python benchmarks/trace_start.py --data data/glyphs-40k --epochs 2 --sample-rate 0.1 \\
        --k 16 --rebuild-every 300 --head knn --seed 0 --stop-at 900 --out runs/trace-s0

The run is the one ``benchmarks/accuracy_study.py`` trains with the same options (same config,
same schedule over all epochs: ``--stop-at`` ends it early without shortening the cosine, which
``--max-steps`` would). The tracer wraps the run's head (the trainer's ``RowHead``) and graph
builder and only reads: the traced run takes the same steps as an untraced one.

Every ``--every`` steps it writes a row to OUT/trace.csv (and prints it):

* ``loss``: the mean loss of the steps since the previous row; ``lr_rows``: the rows' lr;
* the active set's share of labels, graph neighbors and uniform random classes, and each
  group's share of the softmax's probability mass (logQ weights included when on);
* the norms of the active rows of each group and of all rows (mean, coefficient of variation,
  99th percentile, max), and the share of rows a label visit at the peak lr turns by less than
  1 % of their norm (``frozen_share``: norms grown too large to learn);
* the rows' effective step ``lr * |g| / |w|`` per group (median and 99th percentile);
* the logits: mean target cosine, mean hardest negative cosine, the scale ``s``, and the batch
  features' mean pairwise cosine (how alike the backbone's features still are);
* for a fixed probe of classes, the overlap of the graph lists in use with the classes nearest
  by the current rows, and (every ``--means-every`` steps, and right after each graph build)
  with the classes nearest by class-mean features (``--mean-images`` training images per
  class through the current backbone in eval mode).

Graph builds are logged with their step and seconds (and to OUT/graph.csv by the trainer).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accuracy_study import add_config_options, study_config

from workers.data.lmdb_dataset import LmdbImageDataset
from workers.heads import ActiveBatch, ClassifierHead, HeadStep
from workers.predict import images_to_input
from workers.selection import Selection
from xcls.run import build_run


class StopTrace(Exception):
    """Raised by the traced head once ``--stop-at`` steps are done: the trace ends there."""


def neighbor_overlap(lists: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean share of each row of ``truth`` (n, k) found in the same row of ``lists`` (n, k'),
    -1 entries never matching."""
    hits = (lists[:, :, None] == truth[:, None, :]) & (truth[:, None, :] >= 0)
    return float(hits.any(dim=1).float().mean())


def nearest_to(queries: torch.Tensor, keys: torch.Tensor, k: int,
               exclude: torch.Tensor) -> torch.Tensor:
    """ids (n, k) of the ``k`` keys of highest cosine to each query, leaving out key
    ``exclude[i]`` (the query's own class) for query i."""
    scores = F.normalize(queries.float(), dim=1) @ F.normalize(keys.float(), dim=1).t()
    scores[torch.arange(exclude.numel()), exclude] = -torch.inf
    return scores.topk(k, dim=1).indices


def quantile(values: torch.Tensor, q: float) -> float:
    return float(torch.quantile(values.double(), q)) if values.numel() else float("nan")


class StartTracer:
    """A ``RowHead`` that delegates every call to the run's head and records what the loss, the
    rows and the active set do (see the module docstring).

    run: the built run (``xcls.run.build_run``); probe: int64 class ids whose neighbor lists are
    checked; mean_images / mean_labels: the training images (uint8) embedded for class means,
    and their labels; every, means_every: trace period and class-means period in steps;
    stop_at: steps after which ``StopTrace`` ends the run; out: OUT/trace.csv's directory.
    """

    def __init__(self, run, probe: torch.Tensor, mean_images: torch.Tensor,
                 mean_labels: torch.Tensor, *, every: int, means_every: int, stop_at: int,
                 out: Path) -> None:
        self.run = run
        self.trainer = run.trainer
        self.head: ClassifierHead = run.trainer.head
        self.client, self.table = run.client, run.trainer.table
        self.num_classes = self.head.num_classes
        self.combine_row_grads = self.head.combine_row_grads
        self.probe, self.mean_images, self.mean_labels = probe, mean_images, mean_labels
        self.every, self.means_every, self.stop_at = every, means_every, stop_at
        self.path = out / "trace.csv"
        self.path.unlink(missing_ok=True)
        self.step = 0
        self.losses: list[float] = []
        self.builds: list[dict] = []
        self._build_graph = self.trainer.build_graph
        if self._build_graph is not None:
            self.trainer.build_graph = self._traced_build
        self.trainer.head = self

    # ---- the RowHead protocol, delegated --------------------------------------------------

    def select(self, labels: torch.Tensor) -> Selection:
        return self.head.select(labels)

    def pull(self, selection: Selection) -> ActiveBatch:
        return self.head.pull(selection)

    def prepare(self, labels: torch.Tensor) -> ActiveBatch:
        return self.head.prepare(labels)

    def sampler_state(self) -> torch.Tensor | None:
        return self.head.sampler_state()

    def load_sampler_state(self, state: torch.Tensor | None) -> None:
        self.head.load_sampler_state(state)

    def forward_backward(self, features: torch.Tensor, batch: ActiveBatch,
                         logq: bool = True) -> HeadStep:
        if self.step >= self.stop_at:
            # raised in the step after the last, so that one was logged and pushed in full
            raise StopTrace
        out = self.head.forward_backward(features, batch, logq)
        self.losses.append(out.loss)
        step = self.step
        self.step += 1
        if self.step % self.every == 0 or step == 0:
            self._record(step, features, batch, out, logq)
        return out

    # ---- what is recorded -----------------------------------------------------------------

    def _traced_build(self, step: int):
        report = self._build_graph(step)
        build = {"step": step, "seconds": round(report.seconds, 2)}
        build.update(self._graph_vs_means())
        self.builds.append(build)
        print(f"graph build after step {step}: {json.dumps(build)}", flush=True)
        return report

    def _class_means(self) -> torch.Tensor:
        """(N, d) each class's mean feature direction over the probe images, by the current
        backbone in eval mode (zero for a class without one)."""
        backbone = self.run.backbone
        was_training = backbone.training
        backbone.eval()
        sums = torch.zeros(self.num_classes, self.run.cfg.model.dim, dtype=torch.float64)
        try:
            with torch.no_grad():
                for start in range(0, self.mean_images.shape[0], 1024):
                    x = images_to_input(self.mean_images[start:start + 1024].to(
                        self.trainer.device))
                    f = F.normalize(backbone(x).float().cpu().double(), dim=1)
                    sums.index_add_(0, self.mean_labels[start:start + 1024], f)
        finally:
            backbone.train(was_training)
        return F.normalize(sums, dim=1).float()

    def _graph_lists(self) -> torch.Tensor:
        """The probe classes' graph lists as the head takes them (the class itself dropped)."""
        return self.client.neighbors(self.table, self.probe)[:, 1:self.head.selector.k]

    def _graph_vs_means(self) -> dict:
        """Overlap of the graph lists and of the rows' nearest classes with the classes
        nearest by class means, for the probe."""
        if not hasattr(self.head.selector, "k"):
            return {}
        started = time.perf_counter()
        means = self._class_means()
        rows = self.client.pull(self.table, torch.arange(self.num_classes)).float()
        lists = self._graph_lists()
        k = lists.shape[1]
        truth = nearest_to(means[self.probe], means, k, self.probe)
        by_rows = nearest_to(rows[self.probe], rows, k, self.probe)
        cos = F.cosine_similarity(rows[self.probe], means[self.probe], dim=1)
        return {"graph_vs_means": round(neighbor_overlap(lists, truth), 4),
                "rows_vs_means": round(neighbor_overlap(by_rows, truth), 4),
                "cos_row_mean": round(float(cos.mean()), 4),
                "means_seconds": round(time.perf_counter() - started, 1)}

    def _record(self, step: int, features: torch.Tensor, batch: ActiveBatch,
                out: HeadStep, logq: bool) -> None:
        lr = self.trainer.rows.lrs[step]
        active, target = batch.active_ids, batch.target
        labels = active[target]
        is_label = torch.isin(active, labels)
        is_random = (batch.log_weight > 0) & ~is_label
        groups = {"label": is_label, "neighbor": ~is_label & ~is_random, "random": is_random}
        a = active.numel()
        row = {"step": step + 1, "loss": float(np.mean(self.losses)), "lr_rows": lr,
               "active": a}
        self.losses = []

        x = F.normalize(features.detach().float(), dim=1).cpu()
        w = batch.rows.float()
        cosine = x @ F.normalize(w, dim=1).t()
        with torch.no_grad():
            logits = self.head.margin(cosine.clone(), target)
            if self.head.logq_correction and logq:  # the softmax the step computed
                logits = logits + batch.log_weight
            mass = torch.softmax(logits, dim=1).mean(dim=0)
        rows_norm = w.norm(dim=1)
        grad_norm = out.row_grad.norm(dim=1)
        effective = lr * grad_norm / rows_norm
        for name, mask in groups.items():
            row[f"share_{name}"] = round(int(mask.sum()) / a, 4)
            row[f"mass_{name}"] = round(float(mass[mask].sum()), 4)
            row[f"norm_{name}"] = round(float(rows_norm[mask].mean()), 4) if mask.any() \
                else float("nan")
            row[f"eff_{name}_p50"] = round(quantile(effective[mask], 0.5), 5)
            row[f"eff_{name}_p99"] = round(quantile(effective[mask], 0.99), 5)
        negatives = cosine.clone()
        negatives[torch.arange(target.numel()), target] = -torch.inf
        row["cos_target"] = round(float(cosine[torch.arange(target.numel()), target].mean()), 4)
        row["cos_hardest_negative"] = round(float(negatives.max(dim=1).values.mean()), 4)
        row["scale"] = self.head.margin.s
        b = x.shape[0]
        row["feature_mean_cos"] = round(float((x.sum(0).square().sum() - b) / (b * (b - 1))), 4)

        every_row = self.client.pull(self.table, torch.arange(self.num_classes)).float()
        norms = every_row.norm(dim=1)
        row.update({"norm_all_mean": round(float(norms.mean()), 4),
                    "norm_all_cv": round(float(norms.std() / norms.mean()), 4),
                    "norm_all_p99": round(quantile(norms, 0.99), 4),
                    "norm_all_max": round(float(norms.max()), 4),
                    "frozen_share": round(float((self._label_step(norms) < 0.01).float().mean()),
                                          4)})
        if hasattr(self.head.selector, "k"):
            lists = self._graph_lists()
            by_rows = nearest_to(every_row[self.probe], every_row, lists.shape[1], self.probe)
            row["graph_vs_rows"] = round(neighbor_overlap(lists, by_rows), 4)
            if self.means_every and (step + 1) % self.means_every == 0:
                row.update(self._graph_vs_means())
        self._write(row)

    def _label_step(self, norms: torch.Tensor) -> torch.Tensor:
        """The largest step a label visit at the rows' peak lr can take, relative to the row:
        lr · (s / B) / |w|^2 (the cosine's gradient is at most 1 / |w|, CosFace's loss's
        s / B per sample). Below 0.01 a row turns less than about half a degree a visit:
        frozen."""
        peak = max(self.trainer.rows.lrs)
        return peak * self.head.margin.s / (self.trainer.plan.batch_size * norms.square())

    def _write(self, row: dict) -> None:
        new = not self.path.exists()
        with open(self.path, "a", newline="") as f:
            # the class-means columns appear only in some rows: every row has every column
            writer = csv.DictWriter(f, fieldnames=TRACE_COLUMNS, extrasaction="raise")
            if new:
                writer.writeheader()
            writer.writerow(row)
        print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in row.items()), flush=True)


TRACE_COLUMNS = (
    ["step", "loss", "lr_rows", "active"]
    + [c for group in ("label", "neighbor", "random")
       for c in (f"share_{group}", f"mass_{group}", f"norm_{group}", f"eff_{group}_p50",
                 f"eff_{group}_p99")]
    + ["cos_target", "cos_hardest_negative", "scale", "feature_mean_cos", "norm_all_mean",
       "norm_all_cv", "norm_all_p99", "norm_all_max", "frozen_share", "graph_vs_rows",
       "graph_vs_means", "rows_vs_means", "cos_row_mean", "means_seconds"])


def mean_sample(train: LmdbImageDataset, per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``per_class`` training images of every class (uint8 (n, C, H, W)) and their
    labels (n,): a fixed sample that class means are taken over."""
    labels = np.asarray(train.labels())
    order = np.argsort(labels, kind="stable")
    ranks = np.arange(order.size) - np.searchsorted(labels[order], labels[order])
    ids = np.sort(order[ranks < per_class])
    images = torch.stack([train[int(i)][1] for i in ids])
    return images, torch.from_numpy(labels[ids].astype(np.int64))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    add_config_options(p)
    p.add_argument("--head", default="knn", help="full, partial or knn")
    p.add_argument("--stop-at", type=int, default=900, help="end the trace after this step")
    p.add_argument("--every", type=int, default=20, help="steps between trace rows")
    p.add_argument("--means-every", type=int, default=100,
                   help="steps between class-means overlaps (0: only at graph builds)")
    p.add_argument("--mean-images", type=int, default=1,
                   help="training images per class the class means are taken over")
    p.add_argument("--probe", type=int, default=1024,
                   help="classes (evenly spaced ids) whose neighbor lists are checked")
    args = p.parse_args(argv)
    num_classes = json.loads((args.data / "summary.json").read_text())["classes"]
    cfg = study_config(args.head, args, num_classes)
    run = build_run(cfg)
    probe = torch.unique(torch.linspace(0, num_classes - 1, min(args.probe, num_classes),
                                        dtype=torch.float64).long())
    images, labels = mean_sample(run.train_set, args.mean_images)
    out = Path(cfg.train.out_dir)
    tracer = StartTracer(run, probe, images, labels, every=args.every,
                         means_every=args.means_every, stop_at=args.stop_at, out=out)
    try:
        run.trainer.train()
    except StopTrace:
        pass
    (out / "builds.json").write_text(json.dumps(tracer.builds, indent=1))
    print(f"trace: {tracer.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
