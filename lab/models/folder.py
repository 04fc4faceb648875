"""Model folders -> our modules: the folder's spec, its weights as a state dict, its tokenizer.

Reads a local Hugging Face / sentence-transformers folder (the weight files transformers reads:
``model.safetensors`` or the shards ``model.safetensors.index.json`` names, else ``pytorch_model.bin`` with a
warning; a ``.gguf`` file through ``lab.models.gguf``), maps the architecture to our implementation through the
registry in ``lab.models`` and collects what sentence-transformers would use as defaults (``lab.models.st_config``:
pooling mode, Normalize module, max_seq_length, prompts) and an ``llm2vec_config.json``'s knob defaults. No
``trust_remote_code``.

Before any model is built, ``read_folder`` checks the config against itself (sizes, epsilons, RoPE settings) and
against the checkpoint's tensor index (names and shapes, from the safetensors headers): a config that asks for
layers the checkpoint lacks, or for an embedding of another size, fails naming the key and the file instead of
allocating a model the weights cannot fill. ``read_state_dict`` refuses non-finite weights, naming the tensor.
``KeyTracker`` / ``warn_unexpected`` let a family's loader name the tensors it left unread.

    >>> spec = read_folder(path)                 # what is there, no weights loaded
    >>> sd, tokenizer = read_state_dict(spec), load_tokenizer(spec)
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import torch

from lab._warn import warn
from lab.models.checks import check_against_checkpoint, check_config, check_finite, is_int
from lab.models.spec import ModelSpec
from lab.models.st_config import read_json, read_sentence_transformers, register_prefix_tokens


def read_folder(path: str | os.PathLike) -> ModelSpec:
    """Inspect a model folder (or a ``.gguf`` file); raises ``FileNotFoundError`` naming what is missing."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist; pass a local model folder (offline mode)")
    if p.is_file() and p.suffix == ".gguf":
        from lab.models.gguf import cache_gguf_as_safetensors

        return read_folder(cache_gguf_as_safetensors(p))
    if not p.is_dir():
        raise FileNotFoundError(f"{str(p)!r} is neither a model folder nor a .gguf file")
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs:
            return read_folder(ggufs[0])
        raise FileNotFoundError(
            f"no config.json in {str(p)!r}: a transformers model folder needs config.json next to its weights"
        )
    config = read_json(cfg_file, dict, "a JSON object of model settings")
    check_config(config, cfg_file)
    weights, fmt = _find_weights(p)
    spec = ModelSpec(path=p, config=config, weights=weights, weight_format=fmt)
    if fmt == "safetensors":
        spec.tensors = read_tensor_index(weights)
    else:  # memory-mapped: the tensors' data is not read here
        spec.tensors = {k: (tuple(v.shape), f) for f in weights for k, v in load_pickle_weights(f, mmap=True).items()}
    from lab.models import REGISTRY

    if spec.architecture in REGISTRY:
        check_against_checkpoint(config, spec.tensors, _describe_files(spec), cfg_file)
    read_sentence_transformers(p, spec)
    return spec


LLM2VEC_CONFIG = "llm2vec_config.json"
# llm2vec's pooling_mode -> our knob defaults. ``eos_token``: llm2vec appends the EOS token and pools it (our
# ``lasttoken`` appends EOS on decoders by default); ``last_token``: the last token as it is, nothing appended;
# ``bos_token``: the BOS token's state, the first token when the tokenizer adds one (our ``cls``).
LLM2VEC_POOLING = {
    "mean": {"pooling": "mean"},
    "weighted_mean": {"pooling": "weightedmean"},
    "eos_token": {"pooling": "eos_token"},  # the last token after llm2vec's EOS text (lab.engine.framing)
    "last_token": {"pooling": "lasttoken"},  # llm2vec appends no EOS: the llm2vec rule's append_eos default
    "bos_token": {"pooling": "cls"},
}


def read_llm2vec_config(folder: str | os.PathLike) -> dict:
    """Knob defaults from ``folder``'s ``llm2vec_config.json`` (what ``LLM2Vec.save`` writes and
    ``LLM2Vec.from_pretrained`` reads): ``pooling_mode`` -> ``pooling`` (``LLM2VEC_POOLING``), ``max_length`` and
    ``doc_max_length`` -> the knobs of those names, ``skip_instruction`` -> ``include_instruction`` (its negation).
    ``{}`` without the file. A value of the wrong type or an unknown pooling mode raises ``ValueError`` naming the
    file and the key; unknown keys are left out, with a warning."""
    f = Path(folder).expanduser() / LLM2VEC_CONFIG
    if not f.is_file():
        return {}
    cfg = read_json(f, dict, "a JSON object of LLM2Vec settings (pooling_mode, max_length, skip_instruction)")
    out: dict = {}
    mode = cfg.get("pooling_mode")
    if mode is not None:
        if mode not in LLM2VEC_POOLING:
            raise ValueError(
                f"{f}: pooling_mode {mode!r} is not one llm2vec defines; valid: {', '.join(LLM2VEC_POOLING)}"
            )
        out.update(LLM2VEC_POOLING[mode])
    for key in ("max_length", "doc_max_length"):
        length = cfg.get(key)
        if length is not None:
            if not is_int(length) or length < 1:
                raise ValueError(f"{f}: {key} must be a positive integer (tokens), got {length!r}")
            out[key] = int(length)
    skip = cfg.get("skip_instruction")
    if skip is not None:
        if not isinstance(skip, bool):
            raise ValueError(f"{f}: skip_instruction must be true or false, got {skip!r}")
        out["include_instruction"] = not skip
    unknown = sorted(set(cfg) - {"pooling_mode", "max_length", "doc_max_length", "skip_instruction"})
    if unknown:
        warn(
            f"{f}: key(s) {', '.join(unknown)} are not llm2vec settings this engine reads (pooling_mode, "
            "max_length, doc_max_length, skip_instruction); they are ignored",
        )
    return out


MODEL_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def has_model_weights(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a model's own weights (the files ``read_folder`` reads, or a ``.gguf``)."""
    p = Path(folder).expanduser()
    return any((p / f).is_file() for f in MODEL_WEIGHT_FILES) or any(p.glob("*.gguf"))


# weight files of a model folder that are not the model's weights (read by other loaders)
_OTHER_WEIGHT_FILES = ("adapter_model.safetensors",)


def _find_weights(p: Path) -> tuple[list[Path], str]:
    """The weight files transformers reads: ``model.safetensors``, or the shards ``model.safetensors.index.json``
    names; without either, ``pytorch_model.bin`` (or the shards of ``pytorch_model.bin.index.json``). Other
    ``*.safetensors`` files beside them are left unread, with a warning that lists them."""
    index = p / "model.safetensors.index.json"
    if index.exists():
        files, fmt = _shards(p, index), "safetensors"
    elif (p / "model.safetensors").is_file():
        files, fmt = [p / "model.safetensors"], "safetensors"
    elif (p / "pytorch_model.bin.index.json").exists():
        files, fmt = _shards(p, p / "pytorch_model.bin.index.json"), "bin"
    elif (p / "pytorch_model.bin").is_file():
        files, fmt = [p / "pytorch_model.bin"], "bin"
    else:
        others = sorted(f.name for f in p.glob("*.safetensors") if f.name not in _OTHER_WEIGHT_FILES)
        hint = (
            f"; found {', '.join(others)}, which transformers does not read either: rename the model's weights "
            "to model.safetensors"
            if others
            else ""
        )
        raise FileNotFoundError(
            f"no weights in {str(p)!r}: expected model.safetensors (or a sharded index "
            f"model.safetensors.index.json, or pytorch_model.bin){hint}"
        )
    read = {f.resolve() for f in files}
    unread = sorted(
        f.name for f in p.glob("*.safetensors") if f.resolve() not in read and f.name not in _OTHER_WEIGHT_FILES
    )
    if unread:
        warn(
            f"{p}: weight file(s) {', '.join(unread)} are not read: the model's weights are "
            f"{', '.join(f.name for f in files)}, as transformers reads them (model.safetensors, or the "
            "shards model.safetensors.index.json names); remove or move stale weight files",
        )
    return files, fmt


def _shards(p: Path, index: Path) -> list[Path]:
    """The files a shard index's ``weight_map`` names, each checked to be inside the folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{index} is not a valid shard index (a JSON object with a 'weight_map' of tensor name "
            f"-> file): {type(e).__name__}: {e}"
        ) from None
    for f in files:
        # the name as written must stay inside the folder; the file itself may be a symbolic link, as the Hugging
        # Face hub cache links each snapshot's files to ../../blobs (the same rule as an unsharded model.safetensors)
        if not isinstance(f, str) or os.path.isabs(f) or os.path.normpath(f).split(os.sep)[0] == os.pardir:
            raise ValueError(
                f"{index} names the shard {f!r}, which is not a file inside {p}; refusing to read "
                "weights from outside the model folder"
            )
        if not (p / f).is_file():
            raise FileNotFoundError(f"{index} names the shard {f!r}, which is not in {p}; the download is incomplete")
        target = (p / f).resolve()
        if not any(target.is_relative_to(root) for root in _link_roots(p)):
            raise ValueError(
                f"{index} names the shard {f!r}, a link out of the folder (to {target}); refusing to "
                f"read weights from outside {p}: put the file itself in the folder"
            )
    return [p / f for f in files]


def _link_roots(p: Path) -> list[Path]:
    """Where the files of folder ``p`` may resolve to: ``p`` itself, and for a Hugging Face hub cache snapshot
    (``<repo>/snapshots/<commit>/``, its files links to ``../../blobs``) that repository's ``blobs`` folder."""
    folder = p.resolve()
    roots = [folder]
    if folder.parent.name == "snapshots":
        roots.append((folder.parent.parent / "blobs").resolve())
    return roots


def read_tensor_index(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor's name -> ``(shape, file)`` from the safetensors headers, no data read; a truncated or corrupt
    file raises ``ValueError`` naming it."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, tuple[tuple[int, ...], Path]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[key] = (tuple(st.get_slice(key).get_shape()), f)
        except (SafetensorError, OSError) as e:
            raise _bad_safetensors(f, e) from None
    return out


def _bad_safetensors(f: Path, e: Exception) -> ValueError:
    size = f.stat().st_size if f.exists() else 0
    return ValueError(
        f"{f} is not a valid safetensors file ({size} bytes; {e}): it is truncated or corrupt. "
        "Download or save it again"
    )


def _describe_files(spec: ModelSpec) -> str:
    if len(spec.weights) == 1:
        return str(spec.weights[0])
    index = "model.safetensors.index.json" if spec.weight_format == "safetensors" else "pytorch_model.bin.index.json"
    return f"the {len(spec.weights)} shards of {spec.path / index}"


def _read_multi_vector_dense(folder: Path) -> dict[str, torch.Tensor]:
    """The Dense module's ``linear.weight`` (and ``linear.bias``) as the model's ``colbert_linear`` head."""
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    if st.exists():
        sd = _load_safetensors(st)
    elif pt.exists():
        sd = load_pickle_weights(pt)
    else:
        raise FileNotFoundError(f"no weights in {folder}: expected model.safetensors (the Dense module's linear)")
    if "linear.weight" not in sd:
        raise ValueError(f"{folder}: expected the tensor 'linear.weight', found {sorted(sd)[:4]}")
    return {f"colbert_linear.{k.removeprefix('linear.')}": v for k, v in sd.items() if k.startswith("linear.")}


# bge-m3's per-token heads, saved beside the weights by FlagEmbedding as torch state dicts of one Linear each
M3_HEAD_FILES = ("sparse_linear", "colbert_linear")


class Checkpoint(dict):
    """A state dict that also knows the file each tensor came from (``files``), so errors can name it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.files: dict[str, Path] = {}

    def add(self, tensors: dict[str, torch.Tensor], file: Path) -> None:
        self.update(tensors)
        self.files.update(dict.fromkeys(tensors, file))


def read_state_dict(spec: ModelSpec) -> Checkpoint:
    """All weights of the folder on CPU, in their stored dtype; bge-m3's ``sparse_linear.pt`` /
    ``colbert_linear.pt`` beside them (through ``torch.load(weights_only=True)``) under those prefixes. Every
    floating tensor is checked to be finite (one pass each): a NaN / Inf raises ``ValueError`` naming the tensor
    and its file."""
    sd = Checkpoint()
    if spec.weight_format == "safetensors":
        for f in spec.weights:
            sd.add(_load_safetensors(f), f)
    else:
        warn(
            f"{spec.path}: loading pytorch_model.bin (pickle); convert the folder to safetensors for safe, fast loads",
        )
        for f in spec.weights:
            sd.add(load_pickle_weights(f), f)
    for name in M3_HEAD_FILES:
        f = spec.path / f"{name}.pt"
        if f.exists():
            head = load_pickle_weights(f, what="a state dict of tensors (a Linear's weight and bias)")
            sd.add({f"{name}.{k}": v for k, v in head.items()}, f)
    if spec.multi_vector is not None and spec.multi_vector.dense is not None:
        sd.add(_read_multi_vector_dense(spec.multi_vector.dense), spec.multi_vector.dense)
    for key, t in sd.items():
        check_finite(t, f"tensor {key!r} of {sd.files[key]}")
    return sd


def _load_safetensors(f: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(f))
    except (SafetensorError, OSError) as e:
        raise _bad_safetensors(f, e) from None


_CONVERT_HINT = (
    "convert it once, only if you trust its source: load it with transformers "
    "(AutoModel.from_pretrained(folder)) and save it with save_pretrained(out, safe_serialization=True), "
    "or torch.load(file, weights_only=False) and safetensors.torch.save_file(state_dict, "
    "'model.safetensors'); then load the folder with model.safetensors"
)


def load_pickle_weights(
    f: Path,
    what: str = "a state dict of tensors",
    mmap: bool = False,
    *,
    data: bytes | None = None,
    convert: str = _CONVERT_HINT,
) -> dict[str, torch.Tensor]:
    """A pickle (``torch.save``) weights file through torch's safe loader (``weights_only=True``): tensors and
    plain containers only. A file that needs anything else is refused for safety, and one torch cannot read at all
    is named as corrupt, each with a ``ValueError`` naming the file (``convert``: how to turn it into safetensors).
    ``mmap``: map the tensors' data rather than read it (a file of the older, non-zip format is read); ``data``: the
    file's bytes, already read by the caller."""
    source = f if data is None else io.BytesIO(data)
    try:
        try:
            sd = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap and data is None)
        except RuntimeError:
            if not mmap or data is not None:
                raise
            sd = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" in str(e).lower():
            first = str(e).strip().splitlines()[-1][:200]
            raise ValueError(
                f"{f} is refused for safety: it is a pickle file that holds more than tensors "
                f"({first}), and unpickling it could run arbitrary code. Prefill-lab reads pickle "
                f"weights only through torch's weights_only loader; {convert}"
            ) from None
        raise _bad_pickle(f, e) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise _bad_pickle(f, e) from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ValueError(f"{f} should hold {what}, got {type(sd).__name__}")
    return sd


def _bad_pickle(f: Path, e: Exception) -> ValueError:
    return ValueError(
        f"{f} is not a readable PyTorch weights file ({type(e).__name__}: {str(e)[:200]}): it is "
        "truncated or corrupt. Download or save it again, preferably as safetensors"
    )


_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "sentencepiece.bpe.model",
    "spiece.model",
)


def _check_tokenizer_files(p: Path) -> None:
    """The tokenizer file transformers reads, checked so a broken one fails naming it: ``tokenizer.json`` a JSON
    object; without it, the vocabulary / SentencePiece files present not empty."""
    tok = p / "tokenizer.json"
    if tok.is_file():
        with open(tok, "rb") as f:
            start = f.read(4096).lstrip()
        if not start.startswith(b"{"):  # not an object: parsed in full only then, for the message
            try:
                read_json(tok, dict, "a JSON object (the fast tokenizer: its model, vocabulary and rules)")
            except ValueError as e:
                raise ValueError(f"{e}; download or save the tokenizer again (tokenizer.save_pretrained)") from None
        return
    for name in _TOKENIZER_FILES[1:]:
        f = p / name
        if f.is_file():
            with open(f, "rb") as fh:
                if not fh.read(4096).strip():
                    raise ValueError(
                        f"{f} is empty ({f.stat().st_size} bytes): the tokenizer has no vocabulary; "
                        "download or save the tokenizer again (tokenizer.save_pretrained)"
                    )


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer

    if not any((spec.path / f).exists() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {str(spec.path)!r}: expected one of {', '.join(_TOKENIZER_FILES)} next to config.json"
        )
    _check_tokenizer_files(spec.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(spec.path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"no usable tokenizer in {str(spec.path)!r} (tokenizer.json or vocab files): {e}"
        ) from e
    if spec.multi_vector is not None and spec.multi_vector.prefix_tokens:
        register_prefix_tokens(tokenizer, spec.multi_vector.prefix_tokens)
    return tokenizer


class KeyTracker(dict):
    """A state dict that records which keys a loader read (``[]`` / ``get``), so ``warn_unexpected`` can name the
    tensors it left unread, and that knows their files (``in_file``)."""

    def __init__(self, sd: dict, source: dict | None = None):
        super().__init__(sd)
        self.used: set[str] = set()
        # tensor -> file of the ``Checkpoint`` these tensors came from (``source``, else ``sd``), for ``in_file``
        self.files: dict[str, Path] = getattr(sd if source is None else source, "files", {})

    def __getitem__(self, key):
        self.used.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.used.add(key)
        return super().get(key, default)


def warn_unexpected(sd: KeyTracker, family: str, ignore: tuple[str, ...] = ()) -> None:
    """Warn, as transformers reports UNEXPECTED keys, about checkpoint tensors the loader never read (``ignore``:
    prefixes the family documents as unused, such as BERT's pooler)."""
    extra = sorted(k for k in sd if k not in sd.used and not k.startswith(ignore))
    if extra:
        shown = ", ".join(extra[:6]) + (f" ... ({len(extra)} in all)" if len(extra) > 6 else "")
        warn(
            f"{family} checkpoint has {len(extra)} weight(s) this config.json does not use: {shown}. "
            "transformers reports these as UNEXPECTED; check that the config matches the weights "
            "(num_hidden_layers, architecture)",
        )
