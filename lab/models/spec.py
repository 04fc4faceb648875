"""What a model folder holds: ``ModelSpec`` (its config, weight files and tensor index, and the defaults
sentence-transformers would use: pooling, Normalize, max_seq_length, prompts, SPLADE, multi-vector) and
``MultiVectorSpec`` (a sentence-transformers ``MultiVectorEncoder`` / PyLate ColBERT folder's modules).
``lab.models.folder.read_folder`` fills them; ``lab.models.st_config`` reads the sentence-transformers part.

    >>> spec = read_folder("all-MiniLM-L6-v2")   # lab.models.folder
    >>> spec.architecture, spec.weight_format, spec.pooling, spec.normalize, spec.prompts
    ('BertModel', 'safetensors', 'mean', True, {'query': '', 'document': ''})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lab.models.hub import local_name


@dataclass(frozen=True)
class MultiVectorSpec:
    """A sentence-transformers ``MultiVectorEncoder`` (ColBERT) folder: Transformer, optional token-level Dense,
    MultiVectorMask, optional Normalize, and the Transformer's per-task lengths and query expansion
    (``lab.outputs.multivector`` applies them)."""

    dense: Path | None  # the Dense module's folder (a projection of every token), None without one
    activation: str  # the Dense's activation: "identity" or "tanh"
    normalize: bool  # a token-level Normalize module follows
    skiplist_words: tuple[str, ...]  # MultiVectorMask: tokens left out of scoring ...
    skiplist_tasks: tuple[str, ...]  # ... for these tasks ("document" also covers no task)
    query_expansion: dict | None  # {"strategy": "fixed" | "min", "attend": bool, "token": str | None, "length": int}
    query_length: int | None
    document_length: int | None
    # PyLate's query / document prefixes (e.g. "[unused0]"): made single special tokens if the vocabulary has them
    prefix_tokens: tuple[str, ...] = ()


@dataclass
class ModelSpec:
    """What a model folder holds and what sentence-transformers would default to."""

    path: Path
    config: dict
    weights: list[Path]
    weight_format: str  # "safetensors" | "bin" | "gguf"
    pooling: str | None = None
    include_prompt: bool | None = None  # the Pooling config's (True when it does not say); None: no Pooling config
    normalize: bool = False
    max_seq_length: int | None = None
    # prompt name -> text: sentence-transformers' (>= 5) defaults, empty ``query`` and ``document`` prompts, updated
    # with config_sentence_transformers.json's ``prompts``
    prompts: dict[str, str] = field(default_factory=lambda: {"query": "", "document": ""})
    default_prompt_name: str | None = None  # config_sentence_transformers.json's: the prompt used when none is named
    gguf_file: Path | None = None
    # a sentence-transformers SparseEncoder's SpladePooling: {"pooling_strategy": max|sum, "activation_function":
    # relu|log1p_relu}; None without one
    splade: dict[str, str] | None = None
    multi_vector: MultiVectorSpec | None = None  # a sentence-transformers MultiVectorEncoder (ColBERT) folder
    # the checkpoint's tensors without their data: name -> (shape, file), from the safetensors headers (a pickle
    # file's: memory-mapped)
    tensors: dict[str, tuple[tuple[int, ...], Path]] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        """The folder's name (its parent's when the folder has a generic name such as ``model``)."""
        return local_name(self.path)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else _ARCH_BY_TYPE.get(self.config.get("model_type", ""), "")


_ARCH_BY_TYPE = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}
