"""``python -m tierflow``: the same as the ``tierflow`` command."""

from tierflow.cli import main

raise SystemExit(main())
