"""The probes' classifiers in batched torch: cosine kNN, few-shot kNN and the L2 logistic-regression linear probe.

They replace scikit-learn's `LogisticRegression` fitted one C and one fold at a time (and a numpy kNN): the same
results in far less time, on `evaluate.device` (CPU threads or CUDA). Classes are integer codes 0..K-1 (indices
into the sorted class names); every function returns scores over all K classes. The kNN probes live in `knn`, the
linear probe in `linear_probe`, the device and threads in `torch_runtime`; this module gathers them for the stage.
"""

from __future__ import annotations

from dinov3_core.evaluate.knn import knn_cv, knn_cv_neighbours, knn_few_shot, knn_scores
from dinov3_core.evaluate.linear_probe import Fold, balanced_accuracy, lbfgs, linear_probe, linear_probe_cv
from dinov3_core.evaluate.torch_runtime import resolve_device, torch_threads

__all__ = [
    "Fold",
    "balanced_accuracy",
    "knn_cv",
    "knn_cv_neighbours",
    "knn_few_shot",
    "knn_scores",
    "lbfgs",
    "linear_probe",
    "linear_probe_cv",
    "resolve_device",
    "torch_threads",
]
