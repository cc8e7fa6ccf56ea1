"""wsidino's ML and data code: tiling, the DINOv3 model, training, conversion, export and extraction.

Nothing here imports Prefect or the `flows`/`tasks` packages: every stage is a plain function taking a typed config.
"""

__version__ = "0.1.0"
