"""The sharded strategy's parts on one process: the block plan, activation checkpointing, bf16 policy dtypes, the
meta-device build, safe reading of checkpoint folders, optimizer-state keys, and the one-line errors."""

from __future__ import annotations

import os
import pickle
import socket

import pytest
import timm
import torch
from sharding_harness import LLAMA, fit, save_initial_states, tiny_decoder
from torch import nn

from polyattn_lightning.checkpoint import CheckpointLoadError
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.models.lra_encoder import LRAClassifier
from polyattn_lightning.sharding import NoShardableBlock, ShardedStrategy, shardable_blocks
from polyattn_lightning.sharding.checkpoints import SafeFileSystemReader, by_index, by_name
from polyattn_lightning.sharding.init import materialize
from polyattn_lightning.sharding.memory import saved_bytes_of
from polyattn_lightning.sharding.plan import apply_plan, require_blocks


def hf_llama() -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**LLAMA, vocab_size=64)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


# ---- the plan --------------------------------------------------------------------------------------------------


def test_blocks_are_hf_no_split_classes_and_timm_block_lists():
    assert [type(b).__name__ for b in shardable_blocks(hf_llama())] == ["LlamaDecoderLayer"] * 2
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3)
    assert shardable_blocks(vit) == list(vit.blocks)
    swin = timm.create_model("swin_tiny_patch4_window7_224", depths=(2, 1), num_heads=(1, 2), embed_dim=16)
    assert shardable_blocks(swin) == [*swin.layers[0].blocks, *swin.layers[1].blocks]
    xcit = timm.create_model("xcit_nano_12_p16_224", img_size=32, depth=2, cls_attn_layers=1)
    assert shardable_blocks(xcit) == [*xcit.blocks, *xcit.cls_attn_blocks]
    lra = LRAClassifier(vocab_size=10, max_length=16, dim=16, mlp_dim=16, depth=2, num_heads=2, num_classes=2)
    assert shardable_blocks(lra) == list(lra.encoder.blocks)


def test_a_model_without_blocks_is_a_one_line_error():
    with pytest.raises(NoShardableBlock) as error:
        require_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    message = str(error.value)
    assert "Sequential has no block to shard" in message and "\n" not in message and "_no_split_modules" in message


@pytest.mark.parametrize(
    "options, key",
    [({"tensor_parallel_size": 2}, "tensor_parallel_size 2"), ({"param_dtype": "bf16"}, "param_dtype 'bf16'")],
)
def test_bad_strategy_options_are_one_line_errors(options, key):
    with pytest.raises(ConfigError, match=key):
        ShardedStrategy(**options)


# ---- one rank: activation checkpointing, dtypes, the meta build -------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mesh(one_rank):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return init_device_mesh("cpu", (1,))


def gradients_of(model: nn.Module, mesh, inputs, checkpointing: bool) -> tuple[dict, int]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    apply_plan(model, require_blocks(model), mesh, MixedPrecisionPolicy(), True, checkpointing)
    torch.manual_seed(1)  # drop path draws in the forward; a checkpointed block replays them in its recompute
    saved = saved_bytes_of(lambda: model(inputs))
    torch.manual_seed(1)
    model(inputs).float().pow(2).mean().backward()
    return {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}, saved


@pytest.mark.parametrize("kind", ["vit", "llama"])
def test_activation_checkpointing_gives_the_same_gradients_and_saves_less(mesh, kind):
    def build():
        torch.manual_seed(0)
        if kind == "vit":
            return timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, drop_path_rate=0.3)
        return hf_llama()

    inputs = torch.randn(2, 3, 16, 16) if kind == "vit" else torch.randint(0, 64, (2, 12))
    run = (lambda m: lambda x: m(x)) if kind == "vit" else (lambda m: lambda x: m(input_ids=x).logits)
    plain_model, checkpointed_model = build().train(), build().train()
    plain, plain_saved = gradients_of(_Call(plain_model, run), mesh, inputs, False)
    recomputed, recomputed_saved = gradients_of(_Call(checkpointed_model, run), mesh, inputs, True)
    assert plain.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=0, atol=0, msg=name)
    assert recomputed_saved < 0.7 * plain_saved


class _Call(nn.Module):
    """A model with a forward of one tensor (a Llama takes ``input_ids=``), its blocks where they were."""

    def __init__(self, model: nn.Module, run):
        super().__init__()
        self.model, self._run = model, run(model)

    def forward(self, x):
        return self._run(x)


@pytest.mark.slow
def test_bf16_policy_computes_in_bf16_and_keeps_fp32_master_shards(one_rank, tmp_path):
    init = save_initial_states(tmp_path)["decoder"]
    seen = {}

    def record(module, args, output):
        seen.setdefault("weight", module.weight.dtype)
        seen.setdefault("output", output.dtype)

    model = tiny_decoder()
    model.load_state_dict(torch.load(init, weights_only=True))
    model.model.model.layers[0].mlp.up_proj.register_forward_hook(record)
    from sharding_harness import TokenData
    from training_helpers import cpu_trainer

    trainer = cpu_trainer(strategy=ShardedStrategy(param_dtype="bfloat16"), max_steps=1, limit_val_batches=0)
    trainer.fit(model, TokenData(8))
    assert seen == {"weight": torch.bfloat16, "output": torch.bfloat16}  # gathered and computed in bf16
    params = list(model.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}  # the master shards
    assert {p.grad.dtype for p in params if p.grad is not None} <= {torch.float32}  # reduced in fp32
    states = [v for s in trainer.optimizers[0].state.values() for v in s.values() if v.dim()]
    assert states and {v.dtype for v in states} == {torch.float32}


@pytest.mark.slow
def test_bf16_true_keeps_everything_in_bf16_and_bf16_mixed_refuses_a_param_dtype(one_rank, tmp_path):
    init = save_initial_states(tmp_path)["decoder"]
    _, model = fit("decoder", "poly3", "fsdp", 1, init, 1, precision="bf16-true")
    trainer = model.trainer
    assert {p.dtype for p in model.model.parameters()} == {torch.bfloat16}
    states = [v for s in trainer.optimizers[0].state.values() for v in s.values() if v.dim()]
    assert {v.dtype for v in states} == {torch.bfloat16}
    from sharding_harness import TokenData
    from training_helpers import cpu_trainer

    mixed = cpu_trainer(strategy=ShardedStrategy(param_dtype="bfloat16"), precision="bf16-mixed", max_steps=1)
    with pytest.raises(ConfigError, match="param_dtype bfloat16 and precision bf16-mixed"):
        mixed.fit(tiny_decoder(), TokenData(8))


@pytest.mark.slow
def test_meta_device_build_has_the_models_own_init(meta_built_decoder):
    torch.manual_seed(0)
    ordinary = tiny_decoder()
    built = meta_built_decoder["weights"]
    assert built.keys() == ordinary.state_dict().keys()
    for name, value in built.items():
        assert torch.isfinite(value).all(), name
        if "norm" in name:
            assert torch.equal(value, torch.ones_like(value)), name  # RMSNorm: ones (torch's init has none)
        elif value.dim() == 2:
            assert abs(value.std().item() - 0.02) < 0.004 and abs(value.mean().item()) < 0.004, name  # N(0, 0.02)
    buffers = dict(ordinary.named_buffers())
    assert buffers.keys() == meta_built_decoder["buffers"].keys() and buffers  # RoPE's non-persistent inv_freq
    for name, buffer in meta_built_decoder["buffers"].items():
        torch.testing.assert_close(buffer, buffers[name], rtol=0, atol=0, msg=name)


def test_an_init_that_leaves_a_parameter_unset_is_an_error():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3))

    def weights_only(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.ones_(module.weight)

    with pytest.raises(ConfigError, match=r"leaves 0\.bias unset"):
        materialize(model, torch.device("cpu"), weights_only)


# ---- checkpoint folders -----------------------------------------------------------------------------------------


class _Runs:
    def __reduce__(self):
        return os.system, ("touch pwned",)


def test_a_checkpoint_metadata_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Runs()))
    with pytest.raises(CheckpointLoadError, match="cannot be read safely.*posix.system|os.system"):
        SafeFileSystemReader(tmp_path / "ckpt").read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_optimizer_states_by_name_and_by_index_round_trip():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    groups = [{"params": [model[0].weight, model[2].weight]}, {"params": [model[0].bias, *model[1].parameters()]}]
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    named = by_name(state, model, optimizer)
    assert named["param_groups"][0]["params"] == ["0.weight", "2.weight"]
    assert set(named["state"]) == {"0.weight", "2.weight", "0.bias", "1.weight", "1.bias"}
    again = by_index(named)
    assert again["param_groups"] == state["param_groups"]
    assert again["state"].keys() == state["state"].keys()
    for index, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(again["state"][index][key], value)
