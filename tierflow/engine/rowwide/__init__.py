"""Algorithms over all rows that a block at a time cannot answer, at the level of nodes,
specs, blocks and partials:

* :mod:`.external_sort`: the external merge sort (``np.sort`` and ``np.argsort`` along
  the rows, ``tw.sort_rows``, ``np.partition``);
* :mod:`.topk`: ``tw.topk``'s reduction, the ``k`` largest of each column;
* :mod:`.quantiles`: the passes that find the order statistics of ``np.quantile``,
  ``np.median`` and the others, and NumPy's interpolation on them;
* :mod:`.frequencies`: the reductions of ``np.unique`` (its table of values, counts and
  first indices; its inverse) and ``np.bincount``, and the table's outputs;
* :mod:`.distinct`: distinct values spilled by value range, what ``np.unique``'s table
  merges with.

Imports: the program and below (program, io, graph, gpu; operators, storage, system),
never the API, the runtime, planning or observe. The API imports this package; the
NumPy-facing functions (``np.sort``, ``np.median``, ``np.unique``: their arguments and
lazy results) are in :mod:`tierflow.engine.api`.
"""
