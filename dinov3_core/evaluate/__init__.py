"""The evaluate stage: frozen-feature probes on the lab's annotations and label-free health, and the gate that
decides whether the candidate becomes the registry's `@champion`.

* `labels` — tile labels from QuPath GeoJSON (or a CSV) with shapely;
* `models` — candidate, champion (MLflow registry) and baseline (released weights, or the architecture at init);
* `features` — embedding through the extract stage's model code, cached by model hash; label-free health;
* `probes` — slide-level split, kNN, linear probe, few-shot kNN, bootstrap intervals, paired differences;
* `scoring` — every model's probes on shared folds, the dense probe, the candidate's paired comparisons;
* `gate` — the promotion rule and the registry aliases and tags;
* `evaluation_json` — `EvaluationReport`, evaluation.json as a dataclass;
* `report` — the markdown table, confusion matrices, embedding maps, QuPath predictions and the MLflow log;
* `evaluation` — `run_evaluate(cfg) -> EvaluateResult`, the stage function.
"""
