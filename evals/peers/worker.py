"""One benchmark system in a process of its own, driven by ``evals/bench_peers.py`` over stdin / stdout.

    python evals/peers/worker.py serve               # answer requests, one JSON object a line, one reply each
    python evals/peers/worker.py export SRC DST      # the peers' ONNX / OpenVINO exports of a model folder

Runs under the project's python (kinds ``st-torch`` and ``engine``: ``lab`` from this checkout) or the peers' venv
(``st-onnx``, ``st-openvino``, ``fastembed``); imports only the standard library and numpy until a ``load`` request
names its kind. The protocol's replies go to the process's original stdout; everything else printed there (libraries'
banners and progress) is sent to stderr, which the driver keeps in a log file.

Requests (``op`` plus arguments) and replies (``ok`` plus results, or ``ok: false`` and ``error``, a traceback):

- ``load`` ``kind``, ``model``, ``options``: builds the system; replies ``info`` (``precision`` it runs in,
  ``packages`` with versions, ``settings``, ``torch_threads``, kind-specific extras), ``load_seconds``,
  ``rss_load_delta_mb`` (the resident set after loading minus before, imports included);
- ``texts`` ``key``, ``texts``: keeps a corpus under ``key``;
- ``embed`` ``key``: embeds it (untimed use: the warm-up); replies ``vectors`` (``encode_array``);
- ``time`` ``key``: embeds it; replies ``seconds`` (wall, ``time.perf_counter``) and ``cpu_seconds`` (this process's
  threads, ``time.process_time``), measured around the embedding call alone;
- ``tokens`` ``key``: the real tokens of the corpus after truncation (``st-torch`` only);
- ``reset_peak``: restarts the peak-RSS count (Linux ``/proc/self/clear_refs``); replies ``reset`` (whether it could);
- ``memory``: ``rss_mb`` and ``peak_rss_mb`` (``VmRSS`` / ``VmHWM``);
- ``quit``: replies, then the process exits.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
BATCH_SIZE = 32  # every system's batch (sentence-transformers' default; fastembed's own default is 256)


def encode_array(a) -> dict:
    """A float32 matrix as JSON: shape and base64 of its little-endian bytes (exact, unlike decimal text)."""
    a = np.ascontiguousarray(np.asarray(a, dtype="<f4"))
    return {"shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_array(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["b64"]), dtype="<f4").reshape(d["shape"])


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def memory() -> dict:
    """This process's resident set now and its peak (MiB; None where /proc is missing)."""
    rss, peak = _status_kb("VmRSS"), _status_kb("VmHWM")
    return {"rss_mb": None if rss is None else rss / 1024, "peak_rss_mb": None if peak is None else peak / 1024}


def reset_peak() -> bool:
    """Restart the kernel's peak-RSS count (``VmHWM``) at the current resident set; False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def versions(*names: str) -> str:
    """``name=version;...`` of the installed distributions among ``names``."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for n in names:
        try:
            out.append(f"{n}={version(n)}")
        except PackageNotFoundError:
            pass
    return ";".join(out)


def torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _on_repo_path():
    """``lab`` and ``evals`` from this checkout (the kinds that run under the project's python)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


class StTorch:
    """sentence-transformers on torch (``lab.eval.bench.SentenceTransformerBaseline``), in ``dtype`` on ``device``."""

    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu"):
        _on_repo_path()
        from lab.eval.bench import SentenceTransformerBaseline

        self.base = SentenceTransformerBaseline(model, batch_size=BATCH_SIZE, dtype=dtype, device=device)
        self.info = {
            "precision": dtype,
            "packages": versions("sentence-transformers", "transformers", "torch"),
            "settings": f"batch_size={BATCH_SIZE} device={device}",
        }

    def encode(self, texts):
        return self.base(texts)

    def tokens(self, texts) -> int:
        return self.base.token_counts(texts)[0]


class StOnnx:
    """sentence-transformers with ``backend="onnx"`` (optimum's ORTModel, ONNX Runtime's CPU provider, float32) on
    the exported ``onnx/model.onnx``."""

    def __init__(self, model: str):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(
            model,
            backend="onnx",
            device="cpu",
            model_kwargs={"file_name": "onnx/model.onnx", "provider": "CPUExecutionProvider"},
        )
        self.info = {
            "precision": "float32",
            "packages": versions(
                "sentence-transformers", "transformers", "optimum", "optimum-onnx", "onnxruntime", "torch"
            ),
            "settings": f"batch_size={BATCH_SIZE} provider=CPUExecutionProvider "
            "intra_op_threads=onnxruntime default (physical cores)",
        }

    def encode(self, texts):
        return self.model.encode(texts, batch_size=BATCH_SIZE, convert_to_numpy=True)


OV_PRECISIONS = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


class StOpenVINO:
    """sentence-transformers with ``backend="openvino"`` (optimum-intel's OVModel) on the exported
    ``openvino/openvino_model.xml``; ``precision`` ``default`` keeps OpenVINO's CPU default
    (``INFERENCE_PRECISION_HINT``: bf16 where the CPU has native bfloat16, else f32), ``f32`` forces float32
    through ``model_kwargs={"ov_config": {"INFERENCE_PRECISION_HINT": "f32"}}``. ``info["precision"]`` is the
    compiled model's own hint."""

    def __init__(self, model: str, precision: str = "default"):
        from sentence_transformers import SentenceTransformer

        kwargs = {"file_name": "openvino/openvino_model.xml"}
        if precision != "default":
            kwargs["ov_config"] = {"INFERENCE_PRECISION_HINT": precision}
        self.model = SentenceTransformer(model, backend="openvino", device="cpu", model_kwargs=kwargs)
        compiled = self.model[0].auto_model.request
        if hasattr(compiled, "get_compiled_model"):  # an InferRequest: its CompiledModel holds the properties
            compiled = compiled.get_compiled_model()
        hint = compiled.get_property("INFERENCE_PRECISION_HINT")
        hint = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)  # an openvino.Type: "bf16"
        threads = compiled.get_property("INFERENCE_NUM_THREADS")
        self.info = {
            "precision": OV_PRECISIONS.get(hint, hint),
            "packages": versions(
                "sentence-transformers", "transformers", "optimum", "optimum-intel", "openvino", "torch"
            ),
            "settings": f"batch_size={BATCH_SIZE} INFERENCE_PRECISION_HINT={hint} ({precision}) "
            f"INFERENCE_NUM_THREADS={threads}",
        }

    def encode(self, texts):
        return self.model.encode(texts, batch_size=BATCH_SIZE, convert_to_numpy=True)


class FastEmbed:
    """fastembed's ``TextEmbedding`` on the exported ``onnx/model.onnx``, registered as a custom model with the
    sentence-transformers folder's pooling (mean) and normalization; it truncates at the folder's
    ``tokenizer_config.json`` ``model_max_length`` / ``max_length``, which the export sets to sentence-transformers'
    ``max_seq_length``."""

    NAME = "prefill-lab/all-MiniLM-L6-v2-export"

    def __init__(self, model: str):
        from fastembed import TextEmbedding
        from fastembed.common.model_description import ModelSource, PoolingType

        folder = Path(model)
        pooling = json.loads((folder / "1_Pooling" / "config.json").read_text(encoding="utf-8"))
        # sentence-transformers writes {"pooling_mode": "mean", "embedding_dimension": d} from 5.x on, before that
        # {"pooling_mode_mean_tokens": true, "word_embedding_dimension": d}
        if not (pooling.get("pooling_mode") == "mean" or pooling.get("pooling_mode_mean_tokens")):
            raise ValueError(
                f"{folder}/1_Pooling/config.json pools {pooling}; fastembed's custom model here is "
                "registered with mean pooling"
            )
        dim = pooling.get("embedding_dimension") or pooling["word_embedding_dimension"]
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
        normalize = any(m["type"].endswith("Normalize") for m in modules)
        name = f"{self.NAME}-{folder.name}"
        if not any(d.model == name for d in TextEmbedding._list_supported_models()):
            TextEmbedding.add_custom_model(
                model=name,
                pooling=PoolingType.MEAN,
                normalization=normalize,
                sources=ModelSource(hf=name),
                dim=dim,
                model_file="onnx/model.onnx",
            )
        self.model = TextEmbedding(model_name=name, specific_model_path=str(folder), local_files_only=True)
        self.info = {
            "precision": "float32",
            "packages": versions("fastembed", "onnxruntime", "tokenizers"),
            "settings": f"batch_size={BATCH_SIZE} normalization={normalize} pooling=mean "
            "threads=onnxruntime default (physical cores)",
        }

    def encode(self, texts):
        return np.stack(list(self.model.embed(texts, batch_size=BATCH_SIZE)))


class EngineSystem:
    """``lab.Engine`` in ``dtype`` on ``device`` (CPU: ``tune_allocator=True``, as ``evals/bench_embed.py``;
    ``compile``: the engine's, ``False`` unless the system names the compiled forward; the first calls of its
    graphs, built at load, are ``compile_seconds``); on the CPU
    ``info`` also carries the GEMM roofline for its dtype (``lab.eval.bench.gemm_roofline`` under its plan), the
    weights' size and the size of the copies its plan derives from them (``weights_mb``, ``derived_weights_mb``)."""

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        device: str = "cpu",
        attention_backend: str = "auto",
        compile: bool | None = False,
    ):
        _on_repo_path()
        import torch

        from lab import Engine

        cpu = device == "cpu"
        # compile: False unless the system asks for the compiled forward (True), so the plain rows stay eager
        self.engine = Engine(
            model,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            tune_allocator=True if cpu else None,
            compile=compile,
        )
        paths = ";".join(f"{k}={v}" for k, v in self.engine.cpu_paths.items()) if cpu else ""
        self.info = {
            "precision": dtype,
            "packages": versions("prefill-lab", "torch", "tokenizers"),
            "settings": f"device={device} attention_backend={attention_backend} "
            f"malloc_tuning={self.engine.resolved['malloc_tuning']} cpu_paths=[{paths}]",
        }
        if cpu:
            from lab.eval.bench import gemm_roofline

            cfg = self.engine.spec.config
            roof = gemm_roofline(
                cfg["hidden_size"],
                cfg["intermediate_size"],
                cfg["num_hidden_layers"],
                dtype=getattr(torch, dtype),
                plan=self.engine.runner.plan,
            )
            self.info["roofline_tokens_per_s"] = roof["roofline_tokens_per_s"]
            # the packed / widened weight copies the plan keeps, against the weights themselves (one warm-up call
            # makes every copy the first call would)
            self.engine.embed(["a warm-up sentence for the weight layouts"])
            if compile:  # the graphs of a step run whole and of one shared among the CPU workers, built now
                self.engine.embed([f"warm-up sentence number {i}" for i in range(64)])
                self.info["compile_seconds"] = sum(self.engine.runner.compiled.compile_seconds.values())
            params = sum(p.numel() * p.element_size() for p in self.engine.model.parameters())
            self.info["weights_mb"] = params / 2**20
            self.info["derived_weights_mb"] = self.engine.runner.plan.derived_bytes() / 2**20

    def encode(self, texts):
        return self.engine.embed(texts)


KINDS = {
    "st-torch": StTorch,
    "st-onnx": StOnnx,
    "st-openvino": StOpenVINO,
    "fastembed": FastEmbed,
    "engine": EngineSystem,
}


def handle(state: dict, req: dict) -> dict:
    """One request's reply (``state``: the loaded system and the corpora kept so far)."""
    op = req.get("op")
    if op == "load":
        if req["kind"] not in KINDS:
            raise ValueError(f"unknown kind {req['kind']!r}; valid: {', '.join(KINDS)}")
        before = memory()["rss_mb"]
        t0 = time.perf_counter()
        system = KINDS[req["kind"]](req["model"], **req.get("options", {}))
        load_seconds = time.perf_counter() - t0
        state["system"] = system
        after = memory()["rss_mb"]
        info = {"torch_threads": torch_threads(), **system.info}
        return {
            "info": info,
            "load_seconds": load_seconds,
            "rss_load_delta_mb": None if before is None else after - before,
        }
    if op == "texts":
        state.setdefault("texts", {})[req["key"]] = list(req["texts"])
        return {"count": len(req["texts"])}
    if op in ("embed", "time", "tokens"):
        system, texts = state.get("system"), state.get("texts", {}).get(req["key"])
        if system is None:
            raise RuntimeError("no system loaded: send a load request first")
        if texts is None:
            raise KeyError(f"no texts under key {req['key']!r}: send a texts request first")
        if op == "tokens":
            if not hasattr(system, "tokens"):
                raise ValueError(f"{type(system).__name__} does not count tokens; ask the reference system")
            return {"tokens": int(system.tokens(texts))}
        if op == "embed":
            return {"vectors": encode_array(system.encode(texts))}
        c0, t0 = time.process_time(), time.perf_counter()
        system.encode(texts)
        return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
    if op == "reset_peak":
        return {"reset": reset_peak()}
    if op == "memory":
        return memory()
    if op == "quit":
        return {}
    raise ValueError(f"unknown op {op!r}")


def serve(rfile=None, wfile=None) -> None:
    """Answer requests from ``rfile`` on ``wfile`` until ``quit`` or end of input (default: stdin, and the original
    stdout, whose file descriptor 1 then points at stderr so that nothing else can write into the protocol)."""
    if wfile is None:
        wfile = os.fdopen(os.dup(1), "w", encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
    rfile = rfile or sys.stdin
    state: dict = {}
    for line in rfile:
        if not line.strip():
            continue
        req = {}
        try:
            req = json.loads(line)
            reply = {"ok": True, **handle(state, req)}
        except Exception as e:  # noqa: BLE001 - every failure goes back to the driver, which raises it there
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        wfile.write(json.dumps(reply) + "\n")
        wfile.flush()
        if req.get("op") == "quit":
            return


def export(src: str | Path, dst: str | Path) -> None:
    """``dst``: the sentence-transformers folder ``src`` saved with its ONNX (``onnx/model.onnx``) and OpenVINO
    (``openvino/openvino_model.xml``) exports, as sentence-transformers makes them (``backend=...``, then
    ``save_pretrained``), offline; ``tokenizer_config.json``'s ``model_max_length`` (and ``max_length``, which
    sentence-transformers copies from ``tokenizer.json``'s truncation) set to the folder's ``max_seq_length``:
    fastembed truncates at the smaller of the two."""
    from sentence_transformers import SentenceTransformer

    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    for backend in ("onnx", "openvino"):
        SentenceTransformer(str(src), backend=backend, device="cpu").save_pretrained(str(tmp))
    max_len = json.loads((src / "sentence_bert_config.json").read_text(encoding="utf-8"))["max_seq_length"]
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["model_max_length"] = max_len
    if "max_length" in cfg:  # fastembed truncates at the smaller of the two (the hub tokenizer.json's own 128)
        cfg["max_length"] = max_len
    cfg_path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    for needed in ("onnx/model.onnx", "openvino/openvino_model.xml", "tokenizer.json", "modules.json"):
        if not (tmp / needed).is_file():
            raise FileNotFoundError(f"the export of {src} lacks {needed} (in {tmp})")
    tmp.rename(dst)


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        serve()
    elif argv[:1] == ["export"] and len(argv) == 3:
        export(argv[1], argv[2])
    else:
        raise SystemExit("usage: worker.py serve | worker.py export SRC_MODEL_FOLDER DST_FOLDER")


if __name__ == "__main__":
    main(sys.argv[1:])
