"""Development tools for wsidino, kept out of the ML package (`dinov3_core` holds only what training needs).

* `wsidino_dev.sample_slides`: realistic sample whole-slide images (real SVS/TIFF files) for demos, tests and
  benchmarks;
* `wsidino_dev.serve`: the `make serve` supervisor (local Prefect and MLflow servers, pools, deployments, a worker);
* `wsidino_dev.faults`: fault drills (`WSIDINO_FAULT`), a listener of `dinov3_core.events`.

Command line: ``python -m wsidino_dev samples OUT_DIR`` and ``python -m wsidino_dev serve`` (or ``wsidino-dev``).
This package may import `dinov3_core`, `tasks` and `flows`; none of those may import it (`make demo` calls
``wsidino-dev samples`` and then ``wsidino pipeline``).
"""
