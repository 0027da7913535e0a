"""engine layer: lazy chunked arrays, fusion, plans and the scheduler.

``import tierflow as tw`` gives the public names; see ``docs/engine.md``. The engine's
subpackages, from the top (imports go downward only; ``docs/architecture.md`` and the
import-linter contracts in ``pyproject.toml``): :mod:`.api` (Arrays and NumPy's
functions over them), :mod:`.runtime` (the scheduler and executors), :mod:`.planning`
and :mod:`.observe`, :mod:`.rowwide` (algorithms over all rows), :mod:`.program` (what a
block task runs), :mod:`.io` (readers, sinks, the cache), :mod:`.graph` (nodes and
specs), :mod:`.gpu`; :mod:`.types` holds the contracts between them.
"""
