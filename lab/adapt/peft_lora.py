"""The LoRA that ``mntp`` / ``simcse`` train, and peft, which builds and saves it: ``LoraSpec`` (rank, alpha,
dropout, target modules, the dtype the adapter is stored in; ``DEFAULT_TARGETS``) and ``peft()`` (the module, or an
``ImportError`` naming the ``adapt`` extra where peft is not installed).

    >>> run = mntp(base, texts, "runs/mntp", steps=200, lora=LoraSpec(r=16, alpha=32.0))
"""

from __future__ import annotations

from dataclasses import dataclass

from lab._extras import require

# LoRA targets: Llama-family names for the attention and MLP projections (what llm2vec adapts)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSpec:
    """The LoRA that is trained: rank, alpha, dropout, target modules, and the dtype the adapter is stored in.

    >>> run = mntp(base, texts, "runs/mntp", steps=200, lora=LoraSpec(r=16, alpha=32.0, save_dtype="bfloat16"))
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    save_dtype: str = "float32"  # "bfloat16" halves the folder; the Engine and peft read either


def peft():
    """The ``peft`` module; an ``ImportError`` naming the ``adapt`` extra where it is not installed."""
    return require("peft", extra="adapt", purpose="training LoRA adapters (lab.adapt.train: mntp, simcse)")
