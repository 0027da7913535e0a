"""engine layer: lazy chunked arrays, fusion, plans and the scheduler.

``import tierflow as tw`` gives the public names; see ``docs/engine.md``.
"""
