"""LoRA through peft: adapters on the attention's own q/k/v/o layers (anchored names: patch_embed.proj is no
target), only they and a named head train, and merging gives the same outputs in the model as it was built, which
save_pretrained writes and from_pretrained loads without peft."""

from __future__ import annotations

import conversion_models as cm
import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM

from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.attention.switch.hf import load_pretrained
from polyattn_lightning.conversion.lora import LoraRecipe, add_lora, is_lora, lora_targets, merged, merged_state_dict
from polyattn_lightning.conversion.teacher import run_model
from polyattn_lightning.errors import ConfigError


def switched(make, batch, spec="poly3"):
    model = make()
    set_attention(model, spec, probe=dict(batch) if isinstance(batch, dict) else lambda: model(batch))
    return model


def out(model, batch):
    with torch.no_grad():
        result = run_model(model.eval(), batch)
    return result if isinstance(result, torch.Tensor) else getattr(result, "logits", None)


def test_targets_are_each_attentions_own_layers_by_full_name():
    image = cm.image_samples(16, batches=1)[0]
    vit = switched(cm.vit, image)
    assert lora_targets(vit, ["q", "k", "v", "o"]) == [
        f"blocks.{i}.attn.{name}" for i in range(2) for name in ("qkv", "proj")
    ]  # the fused qkv once; never patch_embed.proj
    llama = switched(cm.llama, cm.token_samples(batches=1)[0])
    assert lora_targets(llama, ["q", "v"]) == [
        f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_proj", "v_proj")
    ]
    bert = switched(cm.bert, cm.token_samples(batches=1)[0])
    assert lora_targets(bert, ["o"]) == [f"encoder.layer.{i}.attention.output.dense" for i in range(2)]
    with pytest.raises(ConfigError, match=r"lora.target: \['x'\] is not a list of q, k, v, o"):
        LoraRecipe(target=["x"])


@pytest.mark.parametrize("layout", ["llama", "gpt2", "vit", "bert"])
def test_only_the_adapters_and_the_head_train_and_merging_keeps_the_outputs(layout):
    make = getattr(cm, layout)
    batch = cm.image_samples(16, batches=1)[0] if layout == "vit" else cm.token_samples(batches=1, padded=True)[0]
    model = switched(make, batch)
    base_keys = list(model.state_dict())
    head = [model.get_classifier()] if layout == "vit" else []
    summary = add_lora(model, LoraRecipe(r=4, alpha=8), trainable=head)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    head_names = {f"head.{n}" for n, _ in head[0].named_parameters()} if head else set()
    assert trainable and all("lora_" in name or name in head_names for name in trainable)
    assert summary["adapters"] == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0
    if layout == "vit":
        assert type(model.patch_embed.proj) is torch.nn.Conv2d
    with torch.no_grad():  # B starts at zero: give the adapters something to merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    assert is_lora(model)
    merged_model = merged(model)
    assert not any(isinstance(m, BaseTunerLayer) for m in merged_model.modules()) and not is_lora(merged_model)
    assert list(merged_model.state_dict()) == base_keys
    by_state = merged_state_dict(model, model.state_dict())  # the sharded export's path: the same weights
    assert set(by_state) == set(base_keys)
    for key, value in merged_model.state_dict().items():
        torch.testing.assert_close(by_state[key], value, rtol=1e-6, atol=1e-6)
    assert all(m.activation_spec == "poly3" for _, m in attention_modules(merged_model))
    expected, got = out(model, batch), out(merged_model, batch)
    if expected is None:  # BertModel: the last hidden state
        expected, got = (run_model(m, batch).last_hidden_state for m in (model, merged_model))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    plain = out(switched(make, batch), batch)
    if plain is not None:
        assert (plain - expected).abs().max() > 1e-3  # the adapters changed the model


def test_a_merged_export_loads_without_peft_and_switches_back(tmp_path):
    batch = cm.token_samples(batches=1)[0]
    model = switched(cm.llama, batch)
    add_lora(model, LoraRecipe(r=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    merged(model).save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert not is_lora(plain) and not any("lora" in k for k in plain.state_dict())
    loaded = load_pretrained(tmp_path, AutoModelForCausalLM)
    torch.testing.assert_close(out(loaded, batch), out(model, batch), rtol=1e-5, atol=1e-5)


def test_the_options_come_as_a_recipe_a_mapping_or_keywords_and_an_unknown_one_is_refused_in_one_line():
    batch = cm.token_samples(batches=1)[0]
    counts = []
    for options in (
        {"recipe": LoraRecipe(r=2, target=["q", "v"])},
        {"recipe": {"r": 2, "target": ["q", "v"]}},
        {"r": 2, "target": ["q", "v"]},
    ):
        counts.append(add_lora(switched(cm.llama, batch), **options)["adapters"])
    # 2 layers, r 2 on q (32 x 32) and v (16 x 32): A and B each
    assert counts[0] == counts[1] == counts[2] == 2 * (2 * (32 + 32) + 2 * (32 + 16))
    model = switched(cm.llama, batch)
    refusals = [
        (
            lambda: add_lora(model, dropuot=0.1),
            (
                "add_lora has no option 'dropuot' (did you mean 'dropout'?); its options: recipe, trainable, r, "
                "alpha, dropout, target"
            ),
        ),
        (lambda: add_lora(model, rank=4), "add_lora has no option 'rank'; its options: recipe, trainable, r, "),
        (
            lambda: add_lora(model, {"r": 2, "alfa": 4.0}),
            "lora has no option 'alfa' (did you mean 'alpha'?); its options: r, alpha, dropout, target",
        ),
        (lambda: LoraRecipe(**{"targets": ["q"]}), "lora has no option 'targets' (did you mean 'target'?)"),
        (lambda: add_lora(model, LoraRecipe(), r=4), "add_lora: the options are given twice, as recipe and as r"),
    ]
    for call, message in refusals:
        with pytest.raises(ConfigError) as refused:
            call()
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert not is_lora(model)  # nothing was put on the model by a refused call
