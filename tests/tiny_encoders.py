"""Tiny random BERT / RoBERTa / XLM-R checkpoints (optionally with a classification or masked-LM head), saved to a
folder.

They reuse the all-MiniLM-L6-v2 WordPiece tokenizer, so any text tokenizes offline; the weights are random, which is
all a parity test against transformers on the same weights needs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def tiny_encoder(
    out: Path,
    minilm_path: str,
    kind: str = "bert",
    *,
    num_labels: int | None = None,
    masked_lm: bool = False,
    hidden: int = 48,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 128,
) -> Path:
    """Save a random ``kind`` (bert / roberta / xlm-roberta) model, its ``ForSequenceClassification``
    (``num_labels``) or its ``ForMaskedLM`` (``masked_lm``; decoder tied to the word embeddings)."""
    import transformers as tf

    cfg_cls, base, head = {
        "bert": (tf.BertConfig, tf.BertModel, tf.BertForSequenceClassification),
        "roberta": (tf.RobertaConfig, tf.RobertaModel, tf.RobertaForSequenceClassification),
        "xlm-roberta": (tf.XLMRobertaConfig, tf.XLMRobertaModel, tf.XLMRobertaForSequenceClassification),
    }[kind]
    if masked_lm:
        base = {"bert": tf.BertForMaskedLM, "roberta": tf.RobertaForMaskedLM, "xlm-roberta": tf.XLMRobertaForMaskedLM}[
            kind
        ]
    extra = {} if kind == "bert" else {"pad_token_id": 0, "bos_token_id": 101, "eos_token_id": 102}
    cfg = cfg_cls(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 2 + 8,
        max_position_embeddings=max_positions,
        type_vocab_size=2,
        **extra,
    )
    if num_labels is not None:
        cfg.num_labels = num_labels
    torch.manual_seed(1234)
    model = (head if num_labels is not None else base)(cfg).eval()
    with torch.no_grad():  # break the symmetry of fresh LayerNorms/biases so every weight matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copy(Path(minilm_path) / f, out / f)
    return out
