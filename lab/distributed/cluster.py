"""The Ray cluster plumbing ``RayEngine`` runs on: joining or starting a cluster, checking it has room for the
actors before starting them, waiting for them to load, the environment and the model reference they get, and
``ray.get`` with an actor's own exception re-raised.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable

try:
    import ray
except ImportError as e:  # the core engine does not need Ray; only lab.distributed's engines and jobs do
    raise ImportError(
        'lab.distributed needs Ray, which prefill-lab installs with its "ray" extra: '
        'pip install -e ".[ray]"  (or: pip install "ray[data]>=2.9")'
    ) from e

from lab.models.hub import looks_like_hub_id, pin

# Environment the actors get from the driver: offline flags, where the Hugging Face cache and hub are and the token
# (models by hub id), and the engine's own LAB_* settings.
FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_ENDPOINT",
    "HF_TOKEN",
    "HF_HUB_DISABLE_PROGRESS_BARS",
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PLACE_WAIT = 5.0  # seconds to wait for free CPUs / GPUs before starting actors (a closed RayEngine frees them soon)


def connect(address: str | None) -> bool:
    """Use the running Ray connection, or start one: ``address=None`` a new local cluster (never one found on the
    machine), else ``ray.init(address=address)``. True when this call started it."""
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(address="local", include_dashboard=False)
    else:
        ray.init(address=address)
    return True


def wants_gpu(device: str) -> bool:
    """One GPU per actor: for ``cuda`` devices, and for ``auto`` when the cluster has GPUs."""
    if device == "auto":
        return ray.cluster_resources().get("GPU", 0) >= 1
    return str(device).startswith("cuda")


def get(refs):
    """``ray.get``, with an exception raised inside an actor re-raised as itself (a ``ValueError`` stays one, with
    its own message; the actor's traceback is chained)."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from e
        raise


def check_room(num_actors: int, options: dict, held: Iterable, wait: float = PLACE_WAIT) -> None:
    """``RuntimeError`` at once, rather than ``load_timeout`` later, when the cluster has too few free CPUs (or
    GPUs) for ``num_actors`` actors with these ``options``: it names what they need, what is free of what the
    cluster has, and the RayEngines of this process that hold CPUs (``held``: this process's open ones). Waits up
    to ``wait`` seconds first, for actors just killed to hand theirs back."""
    need = {"CPU": num_actors * options["num_cpus"], "GPU": num_actors * options["num_gpus"]}
    deadline = time.monotonic() + wait
    while True:
        free = ray.available_resources()
        short = [r for r, n in need.items() if n and free.get(r, 0.0) < n]
        if not short or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if not short:
        return
    total = ray.cluster_resources()
    have = ", ".join(f"{free.get(r, 0.0):g} of its {total.get(r, 0.0):g} {r}(s) free" for r in short)
    held = [f"{r!r} ({len(r.actors)} actor(s) x {r.threads_per_actor} CPU(s))" for r in list(held) if r.actors]
    holders = (
        f"; held in this process by {', '.join(held)}: close it (reng.close()) or hand it to "
        "embed_dataset(reng, ...) instead of a model path"
        if held
        else "; what holds them is outside this process (other drivers or actors on the cluster)"
    )
    asks = " and ".join(f"{n:g} {r}(s)" for r, n in need.items() if n)
    raise RuntimeError(
        f"{num_actors} Ray actor(s) asking for {options['num_cpus']} CPU(s) and "
        f"{options['num_gpus']} GPU(s) each need {asks}, but the cluster has {have}{holders}; or use "
        "fewer actors / threads_per_actor"
    )


def actor_model(model, knobs: dict) -> tuple[str, dict]:
    """What the actors load: a local path made absolute (actors need not share the driver's working directory), or
    a hub id with its revision pinned to the commit it means now (``lab.models.hub.pin``; the ``revision`` knob
    then holds that commit), so that every actor loads one snapshot."""
    path = os.fspath(model)
    if os.path.exists(path):
        return os.path.abspath(path), dict(knobs)
    if not looks_like_hub_id(path):  # a folder the actors' nodes hold and this one does not
        return path, dict(knobs)
    pinned = pin(path, knobs.get("revision"))
    return pinned[0], {**knobs, "revision": pinned[1]}


def wait_ready(refs: list, timeout: float, model_path: str, options: dict) -> list:
    """The actors' first results, in order; the first actor that fails to start fails it all with its own error
    (an Engine that cannot load), and actors not ready by ``timeout`` seconds raise ``TimeoutError``."""
    deadline = time.monotonic() + timeout
    pending, out = list(refs), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(
                f"{len(pending)} of {len(refs)} Ray actor(s) not ready after {timeout:.0f} s. Each asks for "
                f"{options['num_cpus']} CPU(s) and {options['num_gpus']} GPU(s); the cluster has "
                f"{ray.cluster_resources()} ({ray.available_resources()} free). Use fewer actors or "
                "threads_per_actor, or a larger load_timeout for a slow model"
            )
        try:
            out[ready[0]] = ray.get(ready[0])
        except ray.exceptions.RayError as e:
            lines = [s.strip() for s in ANSI.sub("", str(e)).splitlines() if s.strip()]
            raise RuntimeError(
                f"a Ray actor could not start an Engine on {model_path}: {lines[-1] if lines else type(e).__name__}"
            ) from e
    return [out[r] for r in refs]
