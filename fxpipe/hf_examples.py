"""Hugging Face transformers example factories for ``fxpipe plan pkg.module:factory``: built offline from configs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HF_FACTORIES", "bert_mlm", "gpt2", "gpt2_small", "hf_loss", "llama", "llama3_8b", "make_batch", "vit"]

# Examples are built with dropout off so a split run can be compared with one process exactly.
_NO_DROPOUT_GPT2 = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
_NO_DROPOUT_BERT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # an optional dependency: say how to get it
        raise ImportError("fxpipe.hf_examples needs the transformers package: pip install 'fxpipe[test]' "
                          "or pip install transformers") from error
    return transformers


def _build(model_class: str, config: Any, seed: int, device: str) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        model: nn.Module = getattr(_transformers(), model_class)(config)
    return model.train()


def _token_inputs(batch_size: int, seq_len: int, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)}


def gpt2(*, n_layer: int = 2, n_embd: int = 32, n_head: int = 2, vocab_size: int = 100, seq_len: int = 16,
         batch_size: int = 4, seed: int = 0, device: str = "cpu") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A ``GPT2LMHeadModel`` (tied input/output embeddings); inputs ``{"input_ids": (batch, seq_len)}``."""
    config = _transformers().GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                                        n_positions=max(seq_len, 32), bos_token_id=0, eos_token_id=0,
                                        **_NO_DROPOUT_GPT2)
    return _build("GPT2LMHeadModel", config, seed, device), _token_inputs(batch_size, seq_len, vocab_size, seed)


def gpt2_small(*, batch_size: int = 8, seq_len: int = 1024, device: str = "meta") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """GPT-2 small (124M: 12 layers, 768 wide, 50257 tokens) on the meta device: plans without memory."""
    return gpt2(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq_len=seq_len, batch_size=batch_size,
                device=device)


def bert_mlm(*, num_layers: int = 2, hidden: int = 32, heads: int = 2, vocab_size: int = 100, seq_len: int = 16,
             batch_size: int = 4, seed: int = 0, device: str = "cpu") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A ``BertForMaskedLM``; inputs ``input_ids`` and an ``attention_mask`` (last two tokens padded)."""
    config = _transformers().BertConfig(num_hidden_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                                        intermediate_size=2 * hidden, vocab_size=vocab_size,
                                        max_position_embeddings=max(seq_len, 32), **_NO_DROPOUT_BERT)
    inputs = _token_inputs(batch_size, seq_len, vocab_size, seed)
    inputs["attention_mask"] = torch.ones(batch_size, seq_len, dtype=torch.long)
    inputs["attention_mask"][:, -2:] = 0
    return _build("BertForMaskedLM", config, seed, device), inputs


def llama(*, num_layers: int = 2, hidden: int = 32, heads: int = 2, vocab_size: int = 100, seq_len: int = 16,
          batch_size: int = 4, seed: int = 0, device: str = "cpu", intermediate: int | None = None,
          kv_heads: int = 1) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A ``LlamaForCausalLM`` (rotary embeddings, grouped-query attention with ``kv_heads`` KV heads; MLP width
    ``intermediate``, default 2 x hidden)."""
    config = _transformers().LlamaConfig(num_hidden_layers=num_layers, hidden_size=hidden,
                                         intermediate_size=intermediate or 2 * hidden, num_attention_heads=heads,
                                         num_key_value_heads=kv_heads, vocab_size=vocab_size,
                                         max_position_embeddings=max(seq_len, 32))
    return _build("LlamaForCausalLM", config, seed, device), _token_inputs(batch_size, seq_len, vocab_size, seed)


def llama3_8b(*, batch_size: int = 2, seq_len: int = 4096,
              device: str = "meta") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Llama-3-8B's shape (32 layers, 4096 wide, MLP 14336, 32 heads, 8 KV heads, 128256 tokens) on the meta device."""
    return llama(num_layers=32, hidden=4096, heads=32, vocab_size=128256, seq_len=seq_len, batch_size=batch_size,
                 device=device, intermediate=14336, kv_heads=8)


def vit(*, num_layers: int = 2, hidden: int = 32, heads: int = 2, image_size: int = 16, patch_size: int = 8,
        num_labels: int = 10, batch_size: int = 4, seed: int = 0,
        device: str = "cpu") -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A ``ViTForImageClassification``; inputs ``{"pixel_values": (batch, 3, image_size, image_size)}``."""
    config = _transformers().ViTConfig(num_hidden_layers=num_layers, hidden_size=hidden, num_attention_heads=heads,
                                       intermediate_size=2 * hidden, image_size=image_size, patch_size=patch_size,
                                       num_labels=num_labels, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    return _build("ViTForImageClassification", config, seed, device), {"pixel_values": pixels}


HF_FACTORIES = {"gpt2": gpt2, "bert-mlm": bert_mlm, "llama": llama, "vit": vit}


def hf_loss(output: Mapping[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Batch-mean cross entropy of ``output["logits"]`` (per token for (B, T, V) logits, per sample for (B, V)).

    A split model returns a ModelOutput as a plain dict, so the loss reads ``output["logits"]``,
    which works on a ModelOutput too.
    """
    logits = output["logits"]
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def make_batch(name: str, batch_size: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Deterministic (inputs, targets) for the default tiny ``HF_FACTORIES[name]`` model at ``batch_size`` rows."""
    if name not in HF_FACTORIES:
        raise ValueError(f"unknown Hugging Face example {name!r}; choose one of {sorted(HF_FACTORIES)}")
    generator = torch.Generator().manual_seed(seed)
    if name == "vit":
        pixels = torch.randn(batch_size, 3, 16, 16, generator=generator)
        return {"pixel_values": pixels}, torch.randint(0, 10, (batch_size,), generator=generator)
    inputs = {"input_ids": torch.randint(0, 100, (batch_size, 16), generator=generator)}
    if name == "bert-mlm":
        inputs["attention_mask"] = torch.ones(batch_size, 16, dtype=torch.long)
        inputs["attention_mask"][:, -2:] = 0
    return inputs, torch.randint(0, 100, (batch_size, 16), generator=generator)
