"""A two-node Ray cluster on this machine, run by ``test_clusters.py`` in a subprocess
(one Ray per process, and the suite's session already has one).

``python ray_two_nodes.py FOLDER``: starts ``ray.cluster_utils.Cluster`` with two nodes
of 1 CPU each, each node's processes with a spill folder of their own
(``FOLDER/spill-a``, ``FOLDER/spill-b``), and ``TIERFLOW_SHARED_DIR=FOLDER/shared``;
then, with ``executor="ray"``, computes a ``map_blocks`` result whose blocks (128 KB)
come back through the shared folder, and a reduction. Prints one JSON line: whether
each result equals NumPy's, the nodes and spill folders the blocks ran with, and the
files left in the shared folder.
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
    cluster.add_node(num_cpus=1)
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
        print(
            json.dumps(
                {
                    "nodes": len(ray.nodes()),
                    "compute": bool(np.array_equal(out, data * 3 + 1)),
                    "sum": bool(np.allclose(total, ((data * 3 + 1) * 2).sum(axis=0))),
                    "ran": ran,
                    "shared_left": sorted(os.listdir(folder / "shared")),
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
