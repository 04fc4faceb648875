"""The data and the two objectives of ``lab.adapt.train``: the texts tokenized and cut to ``max_length``
(``tokenize``), each step's batch drawn from windows sorted by length so it pads little (``batch_order``), and the
loss of one batch as a closure over the model: MNTP, a ``mask_rate`` share of the tokens replaced as BERT's collator
does and token ``i`` predicted from position ``i - 1`` (``mntp_loss``; ``mask_token_id`` picks the mask token), and
unsupervised SimCSE, two dropout views of each text mean-pooled, the batch's other texts its negatives
(``simcse_loss``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from lab._warn import warn


def tokenize(tok, texts: Sequence[str], max_length: int) -> list[np.ndarray]:
    enc = tok(list(texts), add_special_tokens=True, truncation=False)["input_ids"]
    cut = sum(len(e) > max_length for e in enc)
    if cut:
        warn(
            f"{cut} of {len(enc)} training texts were longer than max_length={max_length} tokens and were cut",
        )
    return [np.asarray(e[:max_length], dtype=np.int64) for e in enc if len(e)]


def batch_order(ids: list[np.ndarray], batch_size: int, steps: int, seed: int) -> list[np.ndarray]:
    """Indices of each step's batch: the texts shuffled (reshuffled per pass), then sorted by length within windows
    of 50 batches so a batch pads little, and those batches shuffled. Fixed by the seed."""
    rng = np.random.default_rng(seed)
    lengths = np.array([len(x) for x in ids])
    batch_size = min(batch_size, len(ids))
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(len(ids))
        batches = []
        for w in range(0, len(perm), 50 * batch_size):
            win = perm[w : w + 50 * batch_size]
            win = win[np.argsort(lengths[win], kind="stable")]
            batches += [win[i : i + batch_size] for i in range(0, len(win) - batch_size + 1, batch_size)]
        out += [batches[i] for i in rng.permutation(len(batches))]
    return out[:steps]


def _pad(tok, ids: list[np.ndarray], dev) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(x) for x in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    out = np.full((len(ids), longest), pad, dtype=np.int64)
    mask = np.zeros((len(ids), longest), dtype=np.int64)
    for i, x in enumerate(ids):
        out[i, : len(x)], mask[i, : len(x)] = x, 1
    return torch.from_numpy(out).to(dev), torch.from_numpy(mask).to(dev)


def _inner(model):
    """(decoder stack, LM head) of a peft-wrapped ``*ForCausalLM``; LoRA layers live inside them."""
    causal_lm = model.get_base_model()
    return causal_lm.model, causal_lm.get_output_embeddings()


def mask_token_id(tok) -> int:
    """The tokenizer's mask token, else ``_`` (llm2vec's ``blank`` choice for tokenizers without one)."""
    if tok.mask_token_id is not None:
        return tok.mask_token_id
    tid = tok.convert_tokens_to_ids("_")
    if tid is None or tid == tok.unk_token_id:
        tid = tok("_", add_special_tokens=False)["input_ids"][-1]
    return int(tid)


def mntp_loss(model, tok, ids, mask_rate: float, seed: int) -> Callable:
    stack, head = _inner(model)
    dev = next(model.parameters()).device
    mask_id = mask_token_id(tok)
    special = torch.tensor(sorted(set(tok.all_special_ids)), dtype=torch.long)
    vocab = head.weight.shape[0]

    def loss(batch: np.ndarray, step: int):
        x, attn = _pad(tok, [ids[i] for i in batch], "cpu")
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + step)  # per step: a resumed run masks alike
        can = attn.bool() & ~torch.isin(x, special)
        can[:, 0] = False  # token 0 has no position before it to be predicted from
        chosen = (torch.rand(x.shape, generator=g) < mask_rate) & can
        if not chosen.any():  # at least one target per batch
            flat = can.flatten().nonzero()[:, 0]
            chosen.view(-1)[flat[torch.randint(len(flat), (1,), generator=g)]] = True
        roll = torch.rand(x.shape, generator=g)
        inputs = x.clone()
        inputs[chosen & (roll < 0.8)] = mask_id
        rand = chosen & (roll >= 0.8) & (roll < 0.9)
        inputs[rand] = torch.randint(vocab, (int(rand.sum()),), generator=g)
        b, i = chosen.nonzero(as_tuple=True)
        h = stack(input_ids=inputs.to(dev), attention_mask=attn.to(dev)).last_hidden_state  # (B, L, H)
        logits = head(h[b.to(dev), (i - 1).to(dev)])  # (targets, V): token i from position i - 1
        return torch.nn.functional.cross_entropy(logits.float(), x[b, i].to(dev)), int(attn.sum())

    return loss


def simcse_loss(model, tok, ids, temperature: float) -> Callable:
    stack, _ = _inner(model)
    dev = next(model.parameters()).device

    def loss(batch: np.ndarray, step: int):
        x, attn = _pad(tok, [ids[i] for i in batch], dev)
        h = stack(input_ids=torch.cat([x, x]), attention_mask=torch.cat([attn, attn])).last_hidden_state
        m = torch.cat([attn, attn]).unsqueeze(-1).to(h.dtype)
        z = ((h * m).sum(1) / m.sum(1)).float()  # (2B, H) mean pooling
        z = torch.nn.functional.normalize(z, dim=-1)
        n = len(batch)
        sim = z[:n] @ z[n:].T / temperature  # (B, B): view 1 against view 2
        return torch.nn.functional.cross_entropy(sim, torch.arange(n, device=dev)), int(attn.sum()) * 2

    return loss
