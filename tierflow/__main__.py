"""``python -m tierflow``: the same as the ``tierflow`` command."""

from .cli import main

raise SystemExit(main())
