"""The digits data set of the test scripts, without importing scikit-learn.

``load_digits()`` reads the CSV that scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``)
with numpy, as ``sklearn.datasets.load_digits()`` does, and returns the same arrays: ``data``
float64 of shape (1797, 64), values 0..16, and ``target`` int64 of shape (1797,). Importing
scikit-learn costs each rank process about a second of CPU at every start; the scripts start
ranks well over a hundred times in the test suite.
"""

import importlib.util
import os
from types import SimpleNamespace

import numpy as np


def load_digits() -> SimpleNamespace:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("scikit-learn is not installed (the test extra installs it)")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "datasets", "data",
                        "digits.csv.gz")
    table = np.loadtxt(path, delimiter=",")
    return SimpleNamespace(data=table[:, :-1], target=table[:, -1].astype(int, copy=False))
