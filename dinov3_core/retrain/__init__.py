"""Scheduled retraining: one versioned cycle per run over a growing cohort, warm-started from the champion and
gated by the evaluation (`run_cycle`). Plain functions; the Prefect flow (`flows/retrain.py`) and `wsidino
retrain` differ only in how each stage is run."""
