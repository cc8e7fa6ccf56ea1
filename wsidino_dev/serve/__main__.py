"""``python -m wsidino_dev.serve [options]``: the `make serve` supervisor (see `wsidino_dev.serve`)."""

import sys

from wsidino_dev.serve.cli import main

sys.exit(main())
