"""The block program: what one block task runs, in any process.

* :mod:`.program`: a task's program (:class:`~.program.Program`) over its roots;
* :mod:`.roots`: reduce roots (partials, accumulators) and sink roots (held blocks,
  shared files);
* :mod:`.steps`: the steps under them (sources, fused kernels, slices, masks,
  concatenations, cached blocks) and the pool that lends source blocks;
* :mod:`.context`: the context a step runs in, and the one call of an operator that
  halves it and names its errors;
* :mod:`.tasks`: a block task as data, and running one in a worker;
* :mod:`.halving`: out-of-memory retry on the halves of a block;
* :mod:`.float_errors`: floating-point warnings and errors named at the user's line.

Imports: :mod:`tierflow.engine.io`, :mod:`tierflow.engine.graph`,
:mod:`tierflow.engine.gpu`. Imported by the row-wide algorithms, planning, the runtime
and observation; never by the API directly.
"""
