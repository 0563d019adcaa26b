"""The zoo GPT's ``tie_embeddings`` switch (an LM head of its own, as Llama 3 and Qwen2 have; the sharding study's
large-vocabulary cases): untied it holds a second vocabulary matrix, tied (the default) one Parameter."""

from __future__ import annotations

from fxpipe import models


def test_the_head_is_tied_by_default_and_its_own_parameter_when_untied() -> None:
    tied, _ = models.build("gpt-mini", **models.get("gpt-mini").tiny_overrides)
    untied, _ = models.build("gpt-mini", tie_embeddings=False, **models.get("gpt-mini").tiny_overrides)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    extra = untied.wte.weight.numel()
    assert sum(p.numel() for p in untied.parameters()) == sum(p.numel() for p in tied.parameters()) + extra
