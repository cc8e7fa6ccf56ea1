"""The gram-anchoring stage (docs/reference/dinov3.md#losses, #gram-teacher), built on the pretraining stage
(`dinov3_core.train`).

* `teacher` — `find_eval_checkpoints`, `select_gram_teacher` (policies latest / iteration / best_dense),
  `load_gram_teacher` (eval teacher or released backbone; training checkpoints refused with the file to use);
* `config` — `GramConfig` (= `PretrainConfig` + `pretrain_dir` + `gram`), named configs in configs/gram/;
* `anchoring` — `GramTrainer`, `run_gram(cfg) -> GramResult`; `python -m dinov3_core.gram` is the entry point.
"""
