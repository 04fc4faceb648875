"""Tiny random Hugging Face checkpoints for tests: a config, ``model.safetensors`` and a tokenizer in a folder.

Everything is built offline in well under a second: weights come from transformers' own model classes with every
parameter re-drawn from a seeded generator (biases and norm weights included, so a wrongly loaded bias or norm
shows up), and the tokenizer is a byte-level BPE trained in memory on a few sentences (any text tokenizes).

    >>> path = tiny_llama(tmp_path, "qwen3")                      # folder usable by from_pretrained / our loader
    >>> path = tiny_llama(tmp_path, "llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

KINDS = ("llama", "mistral", "qwen2", "qwen3")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A packed batch holds many sequences of different lengths, one after another.",
    "Rotary position embeddings rotate queries and keys by an angle that grows with position.",
    "What is the capital of France? Paris is the capital of France.",
    "Embeddings map text to vectors; rerankers score a query against a document.",
    "0123456789 !?.,;:'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]

# shared sizes: 2 layers, hidden 64, grouped-query attention with 4 query heads over 2 key/value heads
_BASE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

_PER_KIND = {
    "llama": {"tie_word_embeddings": True},
    "mistral": {"tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {"tie_word_embeddings": False},  # q/k/v biases
    "qwen3": {"tie_word_embeddings": True, "head_dim": 32},  # explicit head_dim != hidden / heads, q/k norms
}


def tiny_tokenizer(vocab_size: int = 320):
    """A ``PreTrainedTokenizerFast`` (byte-level BPE) with bos/eos/pad tokens, built without any download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )


def tiny_config(kind: str, vocab_size: int, **overrides):
    """A transformers config object of the given family with the tiny sizes (``overrides`` win)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    kw = {**_BASE, **_PER_KIND[kind], "vocab_size": vocab_size, **overrides}
    return cls(**kw)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Re-draw every parameter: matrices ~ N(0, 0.05^2)·, biases ~ N(0, 0.1^2), norm weights ~ 1 + N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.05 * noise)


def tiny_llama(tmpdir, kind: str = "llama", *, seed: int = 0, **overrides) -> Path:
    """Write a tiny random ``<Kind>ForCausalLM`` checkpoint (config, safetensors, tokenizer) into ``tmpdir/kind``.

    ``overrides`` go into the config (``rope_scaling=...``, ``tie_word_embeddings=...``, ``is_causal=False``).
    Returns the folder.
    """
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    config = tiny_config(kind, len(tok), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    randomize_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    tag = hashlib.sha1(repr(sorted(overrides.items())).encode()).hexdigest()[:10]
    out = Path(tmpdir) / (kind if not overrides and not seed else f"{kind}-{seed}-{tag}")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
