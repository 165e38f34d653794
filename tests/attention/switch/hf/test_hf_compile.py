"""``torch.compile`` of switched HF models: a tiny BERT (padding) and a tiny Llama (causal, grouped-query) with poly3
compile in one graph (``fullgraph``: a graph break raises) and give the eager outputs and gradients (CPU,
``aot_eager`` as for the timm families in tests/attention/test_compile.py)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from hf_models import tiny_bert, tiny_llama, token_batch

from polyattn_lightning.attention import set_attention


@pytest.mark.parametrize("build, output", [(tiny_bert, "last_hidden_state"), (tiny_llama, "logits")],
                         ids=["bert", "llama"])
def test_compiled_switched_model_matches_eager(build, output):
    model = build()
    set_attention(model, "poly3")
    ids, mask = token_batch()

    def loss_and_grads(forward):
        out = getattr(forward(input_ids=ids, attention_mask=mask), output)
        real = out[mask.bool()]  # padded positions' outputs are not defined
        # unused parameters (BERT's pooler): None eagerly, zeros from the compiled graph; zeros for both
        return real, torch.autograd.grad(real.square().sum(), list(model.parameters()), materialize_grads=True)

    eager, eager_grads = loss_and_grads(model)
    torch._dynamo.reset()
    compiled, compiled_grads = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
