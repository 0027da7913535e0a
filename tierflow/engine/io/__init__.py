"""Where rows come from and where results go: readers, sinks, the cache.

* :mod:`.readers`: in-memory arrays, ``.npy`` and raw files, directories of files;
* :mod:`.formats`: Zarr, HDF5 and Parquet readers;
* :mod:`.sinks`: an array in the tiers, a ``.npy`` file, a Zarr array;
* :mod:`.destination`: what a sink may replace, and writing beside and swapping;
* :mod:`.cache`: results kept in a two-tier store across runs;
* :mod:`.persisted`: ``persist(device=...)``'s blocks kept on a GPU.

Imports: :mod:`tierflow.engine.graph` and the layers below the engine.
"""
