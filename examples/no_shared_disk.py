"""A cluster whose workers share no disk: data, intermediates and the cache in object storage.

    python examples/no_shared_disk.py                  # a local S3 server (moto), 2 workers
    python examples/no_shared_disk.py --url s3://my-bucket/tierflow-example \\
        --options '{"endpoint_url": "http://minio:9000"}' --address tcp://host:8786

Without ``--address`` a Dask cluster of two worker processes starts here, each with a
spill folder of its own and no folder they share; without ``--url`` a local S3 server
(moto's, in a process of its own) stands in for object storage. Everything the workers
share goes under the prefix: the input (written as Zarr), the blocks they hand back
(``shared_dir``), an external sort's runs, the cache, and the sorted output (Zarr). The
script sorts the rows by their first column, keeps the rows over a threshold, and
computes the mean and std of every column twice through a cache in the bucket; it
checks each result against the same computation on local threads, counts what is left
under the intermediates' prefix, and removes every object it wrote.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from cluster_pipeline import quiet_close

import tierflow as tw

NAMES = ("input.zarr", "sorted.zarr", "cache", "tmp")  # what the script writes under the prefix


@contextmanager
def local_s3() -> Iterator[tuple[str, dict[str, Any]]]:
    """A local S3 server with a bucket ``example``: the prefix URL and storage options."""
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "example",
        "secret": "example",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=options["endpoint_url"],
            aws_access_key_id="example",
            aws_secret_access_key="example",
            region_name="us-east-1",
        )
        for _ in range(200):  # until the server answers
            try:
                s3.create_bucket(Bucket="example")
                break
            except Exception:
                time.sleep(0.05)
        yield "s3://example/tierflow-example", options
    finally:
        server.terminate()
        server.wait(10)


@contextmanager
def given(url: str, options: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Object storage the user named."""
    yield url, options


@contextmanager
def dask_cluster(address: str | None, scratch: str) -> Iterator[tw.DaskExecutor]:
    """An executor on the scheduler at ``address``, or on two local worker processes
    that each have a spill folder of their own under ``scratch``."""
    import dask
    from distributed import Client, Nanny, Scheduler, SpecCluster

    if address:
        with Client(address) as client:
            executor = tw.DaskExecutor(client)
            yield executor
            executor.close()
        return
    dask.config.set({"temporary-directory": scratch})
    workers = {
        f"node{i}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "dashboard_address": ":0",
                "silence_logs": logging.ERROR,
                "env": {"TIERFLOW_SPILL_DIR": os.path.join(scratch, f"node{i}-spill")},
            },
        }
        for i in range(2)
    }
    cluster = SpecCluster(
        workers=workers,
        scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
        silence_logs=logging.ERROR,
    )
    client = Client(cluster)
    quiet_close(client)  # (see cluster_pipeline.py)
    executor = tw.DaskExecutor(client)
    try:
        yield executor
    finally:
        executor.close()
        client.close()
        cluster.close()


def run(prefix: str, options: dict[str, Any], rows: int, executor: Any) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(prefix, **options)
    tw.config.set(shared_dir=f"{prefix}/tmp", shared_options=options)
    data = np.random.default_rng(0).standard_normal((rows, 8)).astype(np.float32)
    tw.from_array(data, rows=max(1, rows // 8)).to_zarr(
        f"{prefix}/input.zarr", storage_options=options, progress=False
    )
    x = tw.from_zarr(f"{prefix}/input.zarr", storage_options=options)
    print(f"{rows:,} rows x 8 float32 in {prefix}/input.zarr, on {executor!r}")

    start = time.perf_counter()
    tw.sort_rows(x, by=0).to_zarr(
        f"{prefix}/sorted.zarr", storage_options=options, executor=executor, progress=False
    )
    sorted_back = tw.from_zarr(f"{prefix}/sorted.zarr", storage_options=options).compute()
    expected = data[np.argsort(data[:, 0], kind="stable")]
    print(
        f"sorted by column 0 into {prefix}/sorted.zarr in {time.perf_counter() - start:.2f} s; "
        f"identical to NumPy's: {np.array_equal(sorted_back, expected)}"
    )

    kept = x[x[:, 0] > 1.5].compute(executor=executor, progress=False)
    print(
        f"rows with x[:, 0] > 1.5: {len(kept):,}; identical to NumPy's: "
        f"{np.array_equal(kept, data[data[:, 0] > 1.5])}"
    )

    cache = f"{prefix}/cache"
    tw.cache_clear(cache)
    stats = [x.mean(axis=0), x.std(axis=0)]
    first = tw.compute(*stats, executor=executor, cache=cache, progress=False)
    again = tw.compute(*stats, executor=executor, cache=cache, progress=False)
    local = tw.compute(*stats, executor="threads", progress=False)
    info = tw.cache_info(cache)["cache"]
    same = all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    close = all(np.allclose(a, b, rtol=1e-6) for a, b in zip(first, local, strict=True))
    print(
        f"mean and std through the cache in {cache}: second run {info.hits} hits, the same "
        f"values: {same}; equal to threads': {close}"
    )
    fs.invalidate_cache()
    left = fs.find(f"{root}/tmp") if fs.exists(f"{root}/tmp") else []
    print(f"objects left under {prefix}/tmp: {len(left)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an fsspec prefix for everything (default: local S3)")
    parser.add_argument("--options", default="{}", help="its storage options, as JSON")
    parser.add_argument("--address", help="a Dask scheduler (default: two local workers)")
    parser.add_argument("--rows", type=lambda s: int(s.replace("_", "")), default=200_000)
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="tierflow-no-shared-disk-")
    try:
        if args.url:
            server: Any = given(args.url, json.loads(args.options))
        else:
            server = local_s3()
        with server as (prefix, options):
            import fsspec

            fs, root = fsspec.core.url_to_fs(prefix, **options)
            taken = [n for n in NAMES if fs.exists(f"{root}/{n}")]
            if taken:  # never write over, nor remove, what was there
                sys.exit(f"{prefix} already holds {', '.join(taken)}: give a prefix of its own")
            try:
                with dask_cluster(args.address, scratch) as executor:
                    run(prefix.rstrip("/"), options, args.rows, executor)
            finally:
                for name in NAMES:  # what this run wrote
                    if fs.exists(f"{root}/{name}"):
                        fs.rm(f"{root}/{name}", recursive=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
