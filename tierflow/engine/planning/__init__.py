"""From a graph to tasks: counting, planning, lowering.

* :mod:`.counting`: the pass that counts rows per block where they are unknown;
* :mod:`.plan`: stages, passes, tasks, their order and projected memory;
* :mod:`.lower`: fusion of a pass into block programs.

Pure: building a plan allocates nothing and opens no file. Imports the row-wide
algorithms, the program and below; never :mod:`tierflow.engine.api`.
"""
