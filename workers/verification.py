"""Face verification accuracy, as insightface reports it for LFW, CFP-FP and AgeDB-30.

A pair set holds image pairs and a flag per pair: the same identity or not. The model says
"same" when the cosine of the two embeddings reaches a threshold. The pairs are split into 10
contiguous folds; each fold is scored with the threshold that is best on the other nine, and
the accuracy is the mean over the folds (so no pair chooses the threshold it is scored with).
"""

from __future__ import annotations

import torch

# insightface reports LFW, CFP-FP and AgeDB-30 over 10 folds: the same split keeps the
# accuracies comparable with its tables
FOLDS = 10


def best_threshold(scores: torch.Tensor, same: torch.Tensor) -> float:
    """The threshold t that classifies the most pairs right by ``score >= t`` means "same";
    among equally good ones the highest (+inf: call every pair different).

    scores: (n,) float, higher = more alike; same: (n,) bool.
    """
    order = torch.argsort(scores, descending=True, stable=True)
    ranked, flags = scores[order].double(), same[order]
    # calling the first i+1 pairs "same": right on the same ones among them, and on every
    # different one after them
    right = torch.cumsum(flags, 0) + (int((~same).sum()) - torch.cumsum(~flags, 0))
    # a threshold can only fall after the last of a run of tied scores
    ends = torch.ones_like(flags)
    ends[:-1] = ranked[:-1] > ranked[1:]
    right = torch.where(ends, right, torch.full_like(right, -1))
    best = int(right.argmax())  # the first maximum: the highest threshold
    if int(right[best]) <= int((~same).sum()):
        return float("inf")
    return float(ranked[best])


def kfold_accuracy(scores: torch.Tensor, same: torch.Tensor) -> tuple[float, float]:
    """(mean, standard deviation) over ``FOLDS`` contiguous folds of the accuracy on each fold
    at the best threshold of the others. scores: (n,) float; same: (n,) bool; n >= FOLDS.
    The folds are scikit-learn's ``KFold`` ones (insightface's): the first ``n % FOLDS`` hold
    one pair more."""
    n, folds = scores.shape[0], FOLDS
    if same.shape != (n,) or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and flags {tuple(same.shape)} must "
                         "both be (n,)")
    if n < folds:
        raise ValueError(f"{n} pairs cannot make {folds} folds")
    small, larger = divmod(n, folds)
    bounds = [f * small + min(f, larger) for f in range(folds + 1)]
    accuracies = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        held = torch.zeros(n, dtype=torch.bool)
        held[start:stop] = True
        threshold = best_threshold(scores[~held], same[~held])
        said_same = scores[held].double() >= threshold
        accuracies.append(float((said_same == same[held]).double().mean()))
    values = torch.tensor(accuracies, dtype=torch.float64)
    return float(values.mean()), float(values.std(unbiased=False))


def pair_scores(features: torch.Tensor) -> torch.Tensor:
    """Cosines of consecutive pairs: features (2n, d) float -> (n,) float32, pair i being
    rows 2i and 2i+1."""
    if features.shape[0] % 2:
        raise ValueError(f"{features.shape[0]} embeddings do not make pairs")
    unit = torch.nn.functional.normalize(features.float(), dim=1)
    return (unit[0::2] * unit[1::2]).sum(dim=1)
