"""Many engines on a Ray cluster (``ray_engine``: ``RayEngine``, ``embed_dataset``) and the resumable Parquet
shards a corpus is written to (``shards``). Never reaches inside an engine.

    >>> from lab.distributed import RayEngine, embed_dataset, read_embeddings
"""

from __future__ import annotations

from lab._lazy import exports

__all__ = ["ChunkResult", "RayEngine", "RayStats", "embed_dataset", "read_embeddings", "split_by_tokens"]
__getattr__ = exports(globals(), {name: "lab.distributed.ray_engine" for name in __all__})
