"""workers.verification against a float64 brute force, and pair files (.bin) in and out."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from workers.data.errors import DatasetError
from workers.data.importers import PAIR_CLASSES, import_pairs_bin, read_pairs_bin
from workers.data.lmdb_dataset import LmdbImageDataset
from workers.verification import best_threshold, kfold_accuracy, pair_scores


def brute_force(scores: np.ndarray, same: np.ndarray, folds: int) -> tuple[float, float]:
    """Every candidate threshold tried on the other folds, highest first among the best; the
    folds as scikit-learn's KFold documents them: the first n % folds of size n // folds + 1,
    the others n // folds."""
    n = len(scores)
    sizes = np.full(folds, n // folds)
    sizes[:n % folds] += 1
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    accuracies = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        held = np.zeros(n, dtype=bool)
        held[start:stop] = True
        train_s, train_y = scores[~held], same[~held]
        best, best_t = -1.0, np.inf
        for t in [np.inf, *sorted(set(train_s.tolist()), reverse=True)]:
            accuracy = np.mean((train_s >= t) == train_y)
            if accuracy > best:
                best, best_t = accuracy, t
        accuracies.append(np.mean((scores[held] >= best_t) == same[held]))
    return float(np.mean(accuracies)), float(np.std(accuracies))


@pytest.mark.parametrize("seed", range(4))
def test_kfold_accuracy_equals_the_brute_force(seed):
    rng = np.random.default_rng(seed)
    same = rng.random(203) < 0.5
    # rounded: many tied scores; overlapping classes: no perfect threshold
    scores = np.round(np.where(same, 0.4, 0.1) + rng.normal(0, 0.2, 203), 2)
    mean, std = kfold_accuracy(torch.tensor(scores), torch.tensor(same))
    expect_mean, expect_std = brute_force(scores, same, 10)
    assert mean == pytest.approx(expect_mean, abs=1e-12)
    assert std == pytest.approx(expect_std, abs=1e-12)


def test_best_threshold_edge_cases():
    # all different: call nothing the same
    assert best_threshold(torch.tensor([0.9, 0.1]), torch.tensor([False, False])) == np.inf
    # separable: the lowest same score
    assert best_threshold(torch.tensor([0.2, 0.8, 0.7]), torch.tensor([False, True, True])) == \
        pytest.approx(0.7)
    # a tie across the classes cannot be split
    t = best_threshold(torch.tensor([0.5, 0.5, 0.1]), torch.tensor([True, False, False]))
    assert t == np.inf
    with pytest.raises(ValueError, match="cannot make 10 folds"):
        kfold_accuracy(torch.zeros(5), torch.zeros(5, dtype=torch.bool))


def test_pair_scores_are_cosines():
    features = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    unit = features / features.norm(dim=1, keepdim=True)
    expect = (unit[0::2] * unit[1::2]).sum(dim=1)
    torch.testing.assert_close(pair_scores(features).double(), expect, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="do not make pairs"):
        pair_scores(torch.zeros(3, 2))


def _png(value: int, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (value, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def _write_bin(path, images, flags, protocol: int = 2) -> None:
    path.write_bytes(pickle.dumps((images, flags), protocol=protocol))


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])  # 2 spells bytes by a call
def test_pair_file_imports_as_a_two_class_dataset(tmp_path, protocol):
    images = [_png(10 * i) for i in range(6)]
    images[5] = _png(50, size=12)  # another size: resized
    _write_bin(tmp_path / "lfw.bin", images, [True, False, True], protocol)
    meta = import_pairs_bin(tmp_path / "lfw.bin", tmp_path / "lfw", size=8, channels=3)
    assert tuple(meta.class_names) == PAIR_CLASSES and meta.num_samples == 6
    pairs = LmdbImageDataset(tmp_path / "lfw")
    assert pairs.labels().tolist() == [1, 1, 0, 0, 1, 1]
    assert pairs.read_record(0)[1] == images[0]  # kept as it was
    assert pairs[5][1].shape == (3, 8, 8)


class _Payload:
    """Unpickling this would create a directory: a pair file must never run code."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        import os

        return os.mkdir, (self.target,)


@pytest.mark.parametrize("content, message", [
    (pickle.dumps(([b"x", b"y"], [True]))[:-5], "not a pair file"),
    (pickle.dumps(([b"x", b"y", b"z"], [True])), "3 images for 1 pairs"),
    (pickle.dumps(([b"x", "y"], [True])), "image 1 is a str"),
    (pickle.dumps(([b"x", b"y"], [0.5])), "flag 0 is 0.5"),
    (pickle.dumps({"images": []}), "expected a pair"),
    # a bytes object claiming 2**62 bytes: the unpickler would allocate it before reading
    (b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little") + b"abc", "not a pair file"),
])
def test_hostile_pair_files_are_refused(tmp_path, content, message):
    (tmp_path / "bad.bin").write_bytes(content)
    with pytest.raises(DatasetError, match=message):
        read_pairs_bin(tmp_path / "bad.bin")


def test_a_pair_file_that_carries_code_is_refused_without_running_it(tmp_path):
    target = tmp_path / "ran"
    _write_bin(tmp_path / "evil.bin", [_Payload(str(target)), b"y"], [True])
    with pytest.raises(DatasetError, match="names posix.mkdir"):
        read_pairs_bin(tmp_path / "evil.bin")
    assert not target.exists()
    out = subprocess.run([sys.executable, "-m", "xcls", "data", "bin", str(tmp_path / "evil.bin"),
                          "--out", str(tmp_path / "ds")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "names posix.mkdir" in out.stderr
    assert not target.exists() and not (tmp_path / "ds").exists()


class _Pairs(torch.utils.data.Dataset):
    """n pairs of random 3x4x4 images; pair i is 'same' when i is even."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.images = torch.randint(0, 256, (2 * n, 3, 4, 4), generator=g, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return torch.tensor(i), self.images[i], torch.tensor(int(i // 2 % 2 == 0))


@pytest.mark.parametrize("flipped", [False, True])
def test_verification_adds_the_mirror_images_embedding_when_asked(flipped):
    from workers.evaluation import Evaluator

    torch.manual_seed(0)
    # a linear backbone that is not mirror-symmetric, so the mirror changes every feature
    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 6, bias=False))
    pairs = _Pairs(40)
    evaluator = Evaluator(None, "rows", backbone, torch.device("cpu"), num_classes=2, dim=6,
                          train_set=pairs, test_set=None, pair_sets={"toy": pairs},
                          verify_flipped=flipped)
    got = evaluator.verify()

    weight = backbone[1].weight.detach().double().numpy()
    x = pairs.images.double().numpy() / 127.5 - 1.0
    features = x.reshape(len(x), -1) @ weight.T
    if flipped:
        features = features + x[..., ::-1].reshape(len(x), -1) @ weight.T
    unit = features / np.linalg.norm(features, axis=1, keepdims=True)
    scores = np.round((unit[0::2] * unit[1::2]).sum(axis=1), 5)  # float32 noise off the ties
    same = np.arange(40) % 2 == 0
    expect_mean, expect_std = brute_force(scores, same, 10)
    assert got["verify_toy"] == pytest.approx(expect_mean, abs=1e-12)
    assert got["verify_toy_std"] == pytest.approx(expect_std, abs=1e-12)
