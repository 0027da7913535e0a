"""A two-node Ray cluster on this machine, run by ``test_clusters.py`` in a subprocess
(one Ray per process, and the suite's session already has one).

``python ray_two_nodes.py FOLDER``: starts ``ray.cluster_utils.Cluster`` with two nodes
of 1 CPU each, each node's processes with a spill folder of their own
(``FOLDER/spill-a``, ``FOLDER/spill-b``), and ``TIERFLOW_SHARED_DIR=FOLDER/shared``;
then, with ``executor="ray"``, computes a ``map_blocks`` result whose blocks (128 KB)
come back through the shared folder, and a reduction; the whole-array operations (sorts,
unique, value_counts, quantiles, products, QR/SVD, persist, to_zarr, the cache) against
the threads executor; and a compute during which a third node joins and node b leaves.
Prints one JSON line: whether each result equals NumPy's (or the threads executor's),
the nodes and spill folders the blocks ran with, the files left in the shared folder,
and what the membership change did.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


def tagged(folder: str):  # type: ignore[no-untyped-def]
    """A function that notes the node and spill folder it runs with, and holds until
    blocks have run on two nodes (at most 60 s): a node's one CPU stays busy, so Ray
    sends the next block to the other."""

    def work(block: np.ndarray) -> np.ndarray:
        import threading

        import ray

        node = ray.get_runtime_context().get_node_id()
        spill = os.environ.get("TIERFLOW_SPILL_DIR", "")
        with open(os.path.join(folder, f"ran-{os.getpid()}"), "w") as f:
            f.write(f"{node} {spill}")
        for _ in range(3000):
            texts = [Path(folder, n).read_text() for n in os.listdir(folder)]
            nodes = {t.split()[0] for t in texts if t}  # a file may be empty a moment
            if len(nodes) >= 2:
                break
            threading.Event().wait(0.02)
        return block * 3 + 1

    return work


def every_operation(folder: Path) -> dict[str, bool]:
    """The whole-array operations on the cluster, each against the threads executor in
    this process: whether each gives its answer."""
    import tierflow as tw

    rng = np.random.default_rng(17)
    values = rng.integers(0, 40, (12_000, 3)).astype(np.float64) + rng.random((12_000, 3))
    values[:, 2] = np.round(values[:, 2])  # ties for the stable sorts, repeats to count
    np.save(folder / "ops.npy", values)
    x = tw.from_npy(folder / "ops.npy", rows=2_000)  # 6 blocks: 6 sort runs
    cases = {
        "sort": lambda: (np.sort(x, axis=0),),
        "argsort": lambda: (np.argsort(x, axis=0, kind="stable"),),
        "sort_rows": lambda: (tw.sort_rows(x, by=2),),
        "topk": lambda: (tw.topk(x[:, 0], 7),),
        "unique": lambda: (np.unique(x[:, 2]),),
        "value_counts": lambda: tw.value_counts(x[:, 2]),
        "quantiles": lambda: (np.quantile(x, [0.1, 0.5, 0.9], axis=0),),
        "gram": lambda: (x.T @ x,),
        "cov": lambda: (np.cov(x, rowvar=False),),
        "qr": lambda: tuple(tw.linalg.qr(x)),
        "svd": lambda: tuple(tw.linalg.svd(x, full_matrices=False)),
    }
    found = {}
    for name, make in cases.items():
        there = tw.compute(*make(), executor="ray", progress=False)
        here = tw.compute(*make(), executor="threads", progress=False)
        found[name] = all(
            a.shape == b.shape and np.allclose(a, b, rtol=1e-9, atol=1e-9)
            for a, b in zip(there, here, strict=True)
        )
    kept = (x * 2).persist(executor="ray", progress=False)
    found["persist"] = bool(np.array_equal(kept.compute(executor="threads"), values * 2))
    (x + 1).to_zarr(folder / "y.zarr", executor="ray", progress=False)
    back = tw.from_zarr(folder / "y.zarr").compute(executor="threads")
    found["to_zarr"] = bool(np.array_equal(back, values + 1))
    store = str(folder / "cache")
    first = (x * 3).cache(store).sum(axis=0).compute(executor="ray", progress=False)
    again = (x * 3).cache(store).sum(axis=0).compute(executor="ray", progress=False)
    # The re-run sums the kept blocks, the first run summed x * 3 in one fused kernel:
    # the same values, added in another order.
    found["cache"] = bool(
        np.allclose(first, (values * 3).sum(axis=0)) and np.allclose(again, first, rtol=1e-12)
    )
    return found


def held_on(folder: str):  # type: ignore[no-untyped-def]
    """A function that notes the node it runs on and takes 30 ms; once ``hold`` is in
    ``folder`` it waits for ``added`` (the new node is there), and on the node whose
    spill folder is ``spill-b`` it then holds until that node is removed (60 s at
    most)."""

    def work(block: np.ndarray) -> np.ndarray:
        import threading

        import ray

        def wait_for(name: str) -> None:
            for _ in range(3000):
                if os.path.exists(os.path.join(folder, name)):
                    return
                threading.Event().wait(0.02)

        node = ray.get_runtime_context().get_node_id()
        with open(os.path.join(folder, "moves", f"{os.getpid()}-{block[0, 0]!r}"), "w") as f:
            f.write(node)
        threading.Event().wait(0.03)
        if os.path.exists(os.path.join(folder, "hold")):
            wait_for("added")
            if os.environ.get("TIERFLOW_SPILL_DIR", "").endswith("spill-b"):
                wait_for("never")
        return block * 5 - 1

    return work


def membership(cluster, folder: Path, node_b) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """A compute (on a thread) during which a node joins and then node b leaves (on this
    thread: Ray starts a node only from the main thread): whether the result has the
    right bytes, which nodes ran blocks, and what the executor counted."""
    import threading
    import time

    import ray

    import tierflow as tw
    from tierflow.engine.runtime.executors import cluster as engine

    # No backup copies: node b's held blocks would be stragglers, and a backup that won
    # would leave nothing running there to send again when the node goes.
    engine.STRAGGLER_MIN_SECONDS = 600.0
    (folder / "moves").mkdir()
    data = np.random.default_rng(9).random((96 * 50, 4))
    x = tw.from_array(data, rows=50)  # 96 blocks of 30 ms
    executor = tw.RayExecutor()
    done: dict[str, object] = {}

    def compute() -> None:
        try:
            done["out"] = x.map_blocks(held_on(str(folder)), dtype=np.float64).compute(
                executor=executor, progress=False
            )
        except BaseException as exc:
            done["error"] = repr(exc)

    thread = threading.Thread(target=compute, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder / "moves")) < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    (folder / "hold").touch()
    os.environ["TIERFLOW_SPILL_DIR"] = str(folder / "spill-c")
    node_c = cluster.add_node(num_cpus=1)
    os.environ["TIERFLOW_SPILL_DIR"] = str(folder / "spill-driver")
    cluster.wait_for_nodes()
    (folder / "added").touch()
    while time.monotonic() < deadline:  # until a block ran on the new node
        if node_c.node_id in {p.read_text() for p in (folder / "moves").iterdir()}:
            break
        time.sleep(0.02)
    slots = executor.workers
    cluster.remove_node(node_b)
    thread.join(120)
    out = done.get("out")
    ran = {p.read_text() for p in (folder / "moves").iterdir()}
    return {
        "bytes": isinstance(out, np.ndarray) and out.tobytes() == (data * 5 - 1).tobytes(),
        "error": done.get("error"),
        "new_node_ran": node_c.node_id in ran,
        "resent": executor.resent,
        "slots": slots,
        "alive": sum(1 for n in ray.nodes() if n.get("Alive")),
    }


def main(folder: Path) -> None:
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["TIERFLOW_SHARED_DIR"] = str(folder / "shared")
    (folder / "shared").mkdir()
    (folder / "ran").mkdir()
    # A node's processes inherit the environment it was started with.
    os.environ["TIERFLOW_SPILL_DIR"] = str(folder / "spill-a")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    os.environ["TIERFLOW_SPILL_DIR"] = str(folder / "spill-b")
    node_b = cluster.add_node(num_cpus=1)
    os.environ["TIERFLOW_SPILL_DIR"] = str(folder / "spill-driver")
    import ray

    import tierflow as tw

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        data = np.random.default_rng(3).random((16 * 2000, 8))
        x = tw.from_array(data, rows=2000)  # 16 blocks of 128 KB
        y = x.map_blocks(tagged(str(folder / "ran")), dtype=np.float64, row_shape=(8,))
        out = y.compute(executor="ray", progress=False)
        total = (y * 2).sum(axis=0).compute(executor="ray", progress=False)
        ran = sorted({p.read_text() for p in (folder / "ran").iterdir()})
        nodes = len(ray.nodes())
        operations = every_operation(folder)
        shared_left = sorted(os.listdir(folder / "shared"))
        moved = membership(cluster, folder, node_b)
        print(
            json.dumps(
                {
                    "nodes": nodes,
                    "compute": bool(np.array_equal(out, data * 3 + 1)),
                    "sum": bool(np.allclose(total, ((data * 3 + 1) * 2).sum(axis=0))),
                    "ran": ran,
                    "shared_left": shared_left,
                    "operations": operations,
                    "membership": moved,
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
