"""Many engines on a Ray cluster (``ray_engine``: ``RayEngine``; ``cluster``: the Ray plumbing it runs on), the
resumable job that embeds a corpus on them (``dataset``: ``embed_dataset``) and the Parquet shards it writes
(``shards``). Never reaches inside an engine.

    >>> from lab.distributed import RayEngine, embed_dataset, read_embeddings
"""

from __future__ import annotations

from lab._lazy import exports

__all__ = ["ChunkResult", "RayEngine", "RayStats", "embed_dataset", "read_embeddings", "split_by_tokens"]
__getattr__ = exports(
    globals(),
    {
        **{name: "lab.distributed.ray_engine" for name in __all__},
        "embed_dataset": "lab.distributed.dataset",
        "read_embeddings": "lab.distributed.shards",
    },
)
