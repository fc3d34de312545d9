"""``python -m benchmarks.harness``: see :mod:`benchmarks.harness`."""

from .cli import main

raise SystemExit(main())
