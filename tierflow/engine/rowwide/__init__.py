"""Algorithms over all rows that a block at a time cannot answer: the external merge
sort (:mod:`.external_sort`) and distinct values spilled by value range
(:mod:`.distinct`).

Imports: the program and below. Their Array-level functions (``np.sort``,
``np.unique``) are in :mod:`tierflow.engine.api`.
"""
