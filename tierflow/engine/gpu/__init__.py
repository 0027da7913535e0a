"""The GPU tier's plumbing: which GPU a task runs on (:mod:`.tier`), moving blocks to
and from it (:mod:`.transfer`), and which device a pass runs on (:mod:`.offload`).

The bottom of the engine: imports only the layers below it.
"""
