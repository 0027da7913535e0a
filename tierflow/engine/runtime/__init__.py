"""Running a plan's tasks: the scheduler and the executors.

* :mod:`.scheduler`: order, admission against the RAM and GPU budgets, release (its
  docstring states the policy);
* :mod:`.executors`: where tasks run: threads, serial, worker processes, Dask, Ray.

Imports: planning, observation, the program and below; works on nodes and tasks, never
on Arrays (it does not import :mod:`tierflow.engine.api`).
"""
