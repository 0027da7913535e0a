"""Running a plan's tasks: the scheduler and the executors.

* :mod:`.scheduler`: order, admission against the RAM budget, and the loop that takes
  finished tasks (its docstring states the whole policy); beside it :mod:`.devices`
  (device tasks seated on GPU slots), :mod:`.held` (results held for their consumers,
  spilled under pressure) and :mod:`.lane` (the inbox workers report to, and the lane
  of tiny tasks);
* :mod:`.executors`: where tasks run: threads, serial, worker processes, Dask, Ray.

Imports: planning, observation, the program and below; works on nodes and tasks, never
on Arrays (it does not import :mod:`tierflow.engine.api`).
"""
