"""Where rows come from and where results go: one module per source, its reader beside
its sink, and what they share.

* :mod:`.readers`: the reader contract, file identity, values that fit a dtype;
* :mod:`.npy`: ``.npy`` and raw files (``from_npy``, ``from_raw``; ``to_npy``);
* :mod:`.memory`: arrays in memory (``from_array``; ``compute``, ``persist``);
* :mod:`.files`: directories of files (``from_files``);
* :mod:`.zarr`: Zarr arrays (``from_zarr``; ``to_zarr``);
* :mod:`.hdf5`: HDF5 datasets (``from_hdf5``); :mod:`.parquet`: Parquet tables
  (``from_parquet``);
* :mod:`.destination`: what a sink may replace, temporary files, writing beside and
  swapping;
* :mod:`.cache`: results kept in a two-tier store across runs;
* :mod:`.persisted`: ``persist(device=...)``'s blocks kept on a GPU.

(``tw.from_dask`` reads a dask array: :mod:`tierflow.engine.api.dask`.)

Imports: :mod:`tierflow.engine.graph` and the layers below the engine.
"""
