"""What the model hand-off stages share, below them: export and evaluate never import each other, convert and
extract never import evaluate, and they all import this.

* `backbone` — a converted / released backbone from its weights file, wrapped to return (CLS, patch tokens);
* `onnx_runtime` — ONNX Runtime sessions tuned for inference (`ort_session`);
* `feature_model` — `open_model`: an ONNX model or a backbone file as one `FeatureModel` (uint8 tiles → features);
* `loader` — tiles read ahead on reader threads, outputs written behind (`TileReader`, `read_ahead`);
* `team` — the ranks of a torchrun inference job (`Team`, `rank_main`, `rank_device`, `rank_threads`).

The label-free scores (effective rank, augmentation invariance) live in `dinov3_core.train.label_free`: training's
health probe runs them too, and training never imports this layer.
"""
