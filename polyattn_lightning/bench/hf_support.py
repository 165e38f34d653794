"""What ``set_attention`` switches, measured per Hugging Face family: the table of ``docs/reference/hf-models.md``.

:data:`FAMILIES` is the list the tests run (``tests/attention/switch/hf/test_hf_families.py``): one tiny model
per family, built from its config (2 layers, width 32) with position tables drawn at unit scale (HF zeroes
BEiT's and Swin's; a trained checkpoint's are not zero), so that a bias read as a mask shows. :func:`measure`
switches each to ``softmax`` and to ``poly3`` through the one door, with the default probe, and compares the
softmax outputs with HF's own (its default ``sdpa`` or ``eager`` implementation, on a padded batch where the
model takes text). ``python -m polyattn_lightning.bench hf-support --write
docs/reference/hf-models.md`` rewrites the table between its markers; ``--check docs/reference/hf-models.md``
fails when it differs from the measurement. The poly3 outputs are checked against an independent reference
(HF's eager code of each family, copied into the tests with its softmax replaced by ``phi(S) / sqrt(N)``) by the
tests, not here: the table's last column says what they check
(:data:`REFERENCE_CHECKS`, which the tests assert). The ``exports`` column says which ``polyattn export`` formats
work for the family's tiny model, read from ``docs/export-support.json`` (measured by exporting it: ``python -m
polyattn_lightning.bench export-support --kind hf``).
"""

from __future__ import annotations

import copy
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
import transformers
from torch import nn

from ..attention.switch import set_attention
from ..attention.switch.base import attention_modules
from ..attention.switch.hf import probe_inputs
from ..attention.switch.hf.families import adapter_for
from ..attention.switch.reviewed import records
from ..errors import ConfigError
from . import quiet_loggers
from .export_table import export_cell
from .readme_table import Markers, table_command

#: A small text model: 2 layers of width 32, 4 heads (grouped-query models: 2 key/value heads).
TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=0.2,
)
DECODER = dict(TEXT, num_key_value_heads=2, head_dim=8)
VISION = dict(
    image_size=16,
    patch_size=4,
    num_channels=3,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.2,
)
SEQ2SEQ = dict(
    vocab_size=64,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    max_position_embeddings=64,
    init_std=0.2,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
)
SWIN = dict(image_size=16, patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 4], window_size=2)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)


@dataclass(frozen=True)
class Family:
    """One row of the table: a model class of ``transformers`` and the tiny config it is measured with."""

    name: str  # the family, as the table names it
    model: str  # the transformers class measured
    config: dict = field(default_factory=dict)
    module: str = ""  # the transformers module holding the class, when the top level does not export it

    @property
    def key(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


#: Every family of the table (and of the tests), in the table's order.
# fmt: off
FAMILIES: tuple[Family, ...] = (
    # text encoders
    Family("BERT", "BertModel", TEXT),
    Family("RoBERTa", "RobertaModel", dict(TEXT, pad_token_id=1)),
    Family("XLM-RoBERTa", "XLMRobertaModel", dict(TEXT, pad_token_id=1)),
    Family("CamemBERT", "CamembertModel", dict(TEXT, pad_token_id=1)),
    Family("ELECTRA", "ElectraModel", dict(TEXT, embedding_size=32)),
    Family("ALBERT", "AlbertModel", dict(TEXT, embedding_size=16)),
    Family("DistilBERT", "DistilBertModel", dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
                                                  max_position_embeddings=64, initializer_range=0.2)),
    Family("DeBERTa", "DebertaModel", dict(TEXT, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                           max_relative_positions=8)),
    Family("DeBERTa-v2", "DebertaV2Model", dict(TEXT, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                                position_buckets=4, max_relative_positions=8)),
    Family("MPNet", "MPNetModel", dict(TEXT, pad_token_id=1)),
    Family("RoFormer", "RoFormerModel", dict(TEXT, embedding_size=32)),
    Family("Megatron-BERT", "MegatronBertModel", TEXT),
    Family("RemBERT", "RemBertModel", dict(TEXT, input_embedding_size=16, output_embedding_size=32)),
    Family("TAPAS", "TapasModel", TEXT),
    Family("VisualBERT", "VisualBertModel", dict(TEXT, visual_embedding_dim=16)),
    # vision
    Family("ViT", "ViTModel", VISION),
    Family("DeiT", "DeiTModel", VISION),
    Family("DINOv2", "Dinov2Model", VISION),
    Family("DINOv3", "DINOv3ViTModel", dict(VISION, num_register_tokens=2), module="dinov3_vit"),
    Family("YOLOS", "YolosModel", dict(VISION, image_size=[16, 16], num_detection_tokens=2)),
    Family("VideoMAE", "VideoMAEModel", dict(VISION, num_frames=4, tubelet_size=2)),
    Family("BEiT", "BeitModel", dict(VISION, use_relative_position_bias=True)),
    Family("Swin", "SwinModel", SWIN),
    Family("Data2Vec-Vision", "Data2VecVisionModel", dict(VISION, use_relative_position_bias=True)),
    Family("Swin V2", "Swinv2Model", SWIN),
    # image + text
    Family("CLIP", "CLIPModel", dict(text_config=dict(TEXT, projection_dim=16), vision_config=VISION,
                                     projection_dim=16)),
    Family("SigLIP", "SiglipModel", dict(text_config=TEXT, vision_config=VISION)),
    # decoders
    Family("GPT-2", "GPT2Model", dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      initializer_range=0.2)),
    Family("GPT-J", "GPTJModel", dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
                                      initializer_range=0.2)),
    Family("GPT-NeoX", "GPTNeoXModel", dict(TEXT, rotary_pct=0.5)),
    Family("GPTBigCode", "GPTBigCodeModel", dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                 multi_query=True, initializer_range=0.2)),
    Family("GPT-Neo", "GPTNeoModel", dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                          attention_types=[[["global", "local"], 1]], window_size=3,
                                          max_position_embeddings=64, initializer_range=0.2)),
    Family("OPT", "OPTModel", dict(TEXT, ffn_dim=48, word_embed_proj_dim=32, init_std=0.2)),
    Family("Llama", "LlamaModel", DECODER),
    Family("Mistral", "MistralModel", dict(DECODER, sliding_window=4)),
    Family("Mixtral", "MixtralModel", dict(DECODER, **MOE)),
    Family("Qwen2", "Qwen2Model", DECODER),
    Family("Qwen3", "Qwen3Model", DECODER),
    Family("Qwen2-MoE", "Qwen2MoeModel", dict(DECODER, **MOE, shared_expert_intermediate_size=24)),
    Family("Qwen3-MoE", "Qwen3MoeModel", dict(DECODER, **MOE)),
    Family("Gemma", "GemmaModel", DECODER),
    Family("Gemma 2", "Gemma2Model", dict(DECODER, attn_logit_softcapping=5.0, sliding_window=4,
                                          query_pre_attn_scalar=8)),
    Family("Gemma 3", "Gemma3TextModel", dict(DECODER, sliding_window=4, query_pre_attn_scalar=8)),
    Family("Phi", "PhiModel", dict(TEXT, partial_rotary_factor=0.5)),
    Family("Phi-3", "Phi3Model", dict(DECODER, pad_token_id=0)),
    Family("OLMo", "OlmoModel", DECODER),
    Family("StableLM", "StableLmModel", DECODER),
    Family("Cohere", "CohereModel", DECODER),
    Family("Cohere 2", "Cohere2Model", dict(DECODER, sliding_window=4)),
    Family("Starcoder2", "Starcoder2Model", DECODER),
    Family("Granite", "GraniteModel", DECODER),
    Family("DeepSeek-V3", "DeepseekV3Model", dict(DECODER, **MOE, head_dim=4, num_key_value_heads=4,
                                                  n_routed_experts=4, n_group=1, topk_group=1,
                                                  first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16,
                                                  qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
    Family("Llama 4", "Llama4TextModel", dict(DECODER, **MOE, intermediate_size_mlp=48, attention_chunk_size=4)),
    Family("GPT-OSS", "GptOssModel", dict(DECODER, **MOE, sliding_window=4,
                                          layer_types=["sliding_attention", "full_attention"])),
    Family("Doge", "DogeModel", dict(DECODER, keep_window_size=4)),
    Family("JetMoE", "JetMoeModel", dict(DECODER, kv_channels=8, num_local_experts=4, num_experts_per_tok=2)),
    Family("Falcon", "FalconModel", dict(TEXT, num_kv_heads=2, new_decoder_architecture=True)),
    Family("Falcon (ALiBi)", "FalconModel", dict(TEXT, alibi=True, multi_query=True)),
    Family("BLOOM", "BloomModel", dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=4, initializer_range=0.2)),
    # encoder-decoders
    Family("BART", "BartModel", SEQ2SEQ),
    Family("mBART", "MBartModel", SEQ2SEQ),
    Family("Marian", "MarianModel", dict(SEQ2SEQ, decoder_vocab_size=64, decoder_start_token_id=1)),
    Family("Pegasus", "PegasusModel", dict(SEQ2SEQ, decoder_start_token_id=1)),
    Family("M2M100", "M2M100Model", SEQ2SEQ),
    Family("NLLB-MoE", "NllbMoeModel", dict(SEQ2SEQ, num_experts=4, expert_capacity=8, encoder_sparse_step=1,
                                            decoder_sparse_step=1)),
    Family("T5", "T5Model", dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=16)),
    Family("Whisper", "WhisperModel", dict(SEQ2SEQ, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                                           decoder_start_token_id=1)),
    # speech
    Family("wav2vec2", "Wav2Vec2Model", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=48, conv_dim=(16, 16), conv_kernel=(4, 3),
                                             conv_stride=(4, 2), num_conv_pos_embeddings=4,
                                             num_conv_pos_embedding_groups=2, initializer_range=0.2)),
)
# fmt: on

#: The table's last column: what the tests check against their own reference (HF's eager attention with phi in
#: place of softmax). The families switched by the project's adapters, in float64 by
#: ``tests/attention/switch/hf/test_hf_adapters.py`` (which asserts this mapping): the outputs, the gradients of
#: the inputs and parameters, and for the causal ones a cached generation; every other family's outputs, by
#: ``test_hf_families.py`` (:data:`CHECKED_ELSEWHERE`).
REFERENCE_CHECKS = {
    "deberta": "outputs, gradients",
    "deberta-v2": "outputs, gradients",
    "mpnet": "outputs, gradients",
    "roformer": "outputs, gradients, cache",
    "megatron-bert": "outputs, gradients, cache",
    "rembert": "outputs, gradients, cache",
    "tapas": "outputs, gradients",
    "visualbert": "outputs, gradients",
    "data2vec-vision": "outputs, gradients",
    "swin-v2": "outputs, gradients",
    "siglip": "outputs, gradients",
    "gpt-neo": "outputs, gradients, cache",
    "bloom": "outputs, gradients, cache",
    "falcon": "outputs, gradients, cache",  # tests/attention/switch/hf/test_hf_falcon.py, on either route
    "falcon-alibi": "outputs, gradients, cache",
}
CHECKED_ELSEWHERE = "outputs"

#: Parameter names of position tables and sinks, drawn at unit scale (HF zeroes some; a checkpoint's are not).
POSITION_TABLES = re.compile(r"relative_position_bias_table|relative_attention_bias|rel_embeddings|\bsinks\b|q_bias$")


def family(key: str) -> Family:
    """The family of the table with this :attr:`Family.key` (``"gpt-neo"``, ``"swin-v2"``...)."""
    found = [f for f in FAMILIES if f.key == key]
    if not found:
        raise KeyError(f"no family {key!r}; known: {', '.join(f.key for f in FAMILIES)}")
    return found[0]


def model_class(fam: Family) -> type:
    if fam.module:
        module = __import__(f"transformers.models.{fam.module}", fromlist=[fam.model])
        return getattr(module, fam.model)
    return getattr(transformers, fam.model)


def build(fam: Family, seed: int = 0) -> nn.Module:
    """The family's tiny model in eval mode, its position tables (and sinks) drawn from N(0, 1)."""
    cls = model_class(fam)
    torch.manual_seed(seed)
    with quiet_loggers("transformers"):  # tiny configs draw warnings about token ids
        model = cls(cls.config_class(**copy.deepcopy(fam.config))).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if POSITION_TABLES.search(name):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


@dataclass(frozen=True)
class SupportRow:
    family: str
    model: str
    route: str  # "interface" (AttentionInterface), "adapter" (switch/hf/families, switch/mha.py) or both
    switched: str  # attention classes switched, with counts
    state: str  # "switched" | "refused: ..." | "wrong: ..."
    checked: str  # what the tests check against their reference: REFERENCE_CHECKS; "" for a family not switched
    exports: str = ""  # the export formats that work (export_table.export_cell)

    def markdown(self) -> str:
        cells = (self.family, f"`{self.model}`", self.route, self.switched, self.state, self.checked, self.exports)
        return "| " + " | ".join(cells) + " |"


def outputs(out) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output (``ModelOutput`` or tuple), nested outputs included."""
    items = out.to_tuple() if hasattr(out, "to_tuple") else out if isinstance(out, (tuple, list)) else (out,)
    found = []
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            found.append(item)
        elif hasattr(item, "to_tuple") or isinstance(item, (tuple, list)):
            found += outputs(item)
    return found


def real_rows(tensors: list[torch.Tensor], inputs: dict) -> torch.Tensor:
    """``tensors`` flattened into one vector, without the rows of padded tokens (``(B, L, ...)`` outputs whose
    ``B, L`` are the attention mask's): what a padded position outputs is not defined."""
    mask = inputs.get("attention_mask")
    kept = []
    for t in tensors:
        if mask is not None and t.dim() >= 2 and t.shape[:2] == mask.shape:
            t = t[mask.bool()]
        kept.append(t.reshape(-1))
    return torch.cat(kept)


def run(model: nn.Module, inputs: dict) -> torch.Tensor:
    """One no-grad forward's outputs (:func:`real_rows`), from a fixed seed: models that draw in their forward
    (ViT-MAE's random masking) draw the same each time."""
    torch.manual_seed(0)
    with torch.no_grad():
        return real_rows(outputs(model(**inputs)), inputs)


def measure(fam: Family) -> SupportRow:
    """Switch the family's tiny model to softmax (compared with HF's own outputs) and to poly3."""
    model, exports = build(fam), export_cell("hf", fam.name)
    try:
        inputs = probe_inputs(model)
        expected = run(model, inputs)
        softmax = copy.deepcopy(model)
        set_attention(softmax, "softmax")
        error = (run(softmax, inputs) - expected).abs().max().item()
        set_attention(model, "poly3")
        run(model, inputs)
    except ConfigError as refused:
        return SupportRow(fam.name, fam.model, "", "", f"refused: {refused}".replace("|", "/"), "", exports)
    except Exception as err:  # noqa: BLE001 - a family that crashes is a row, not the end of the table
        return SupportRow(fam.name, fam.model, "", "", f"error: {type(err).__name__}: {err}"[:300], "", exports)
    switched_modules = [m for _, m in attention_modules(model)]
    counts = Counter(_hf_class(m).__name__ for m in switched_modules)
    route = " + ".join(sorted({_route(m) for m in switched_modules}, reverse=True))
    switched = "<br>".join(f"`{name}` x{n}" for name, n in sorted(counts.items()))
    state = "switched" if error <= SOFTMAX_PARITY else f"wrong: softmax differs from HF's by {error:.1e}"
    checked = REFERENCE_CHECKS.get(fam.key, CHECKED_ELSEWHERE)
    return SupportRow(fam.name, fam.model, route, switched, state, checked, exports)


#: The largest difference from HF's own softmax outputs that counts as equal.
SOFTMAX_PARITY = 1e-4


def _route(module: nn.Module) -> str:
    """``adapter`` or ``interface``; for a class whose reviewed transformers releases take different routes
    (``attention/switch/reviewed.json``: Falcon), each route with its releases, the same whichever release measures
    it."""
    cls = _hf_class(module)
    recorded = records().get("transformers", {}).get(f"{cls.__module__}.{cls.__qualname__}", {})
    routes: dict[str, list[str]] = {}
    for entry in recorded.values():
        routes.setdefault(entry["route"], []).extend(entry["releases"])
    if len(routes) > 1:
        return " / ".join(f"{route} ({', '.join(sorted(r))})" for route, r in sorted(routes.items(), reverse=True))
    return "adapter" if adapter_for(module) else "interface"


def _hf_class(module: nn.Module) -> type:
    """The transformers (or torch) class a switched module was made from."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith(("transformers.", "torch.")))


#: The documentation page that holds the table, relative to the checkout
PAGE = "docs/reference/hf-models.md"
BEGIN = f"<!-- hf-support: begin (python -m polyattn_lightning.bench hf-support --write {PAGE}) -->"
END = "<!-- hf-support: end -->"


def table(rows: list[SupportRow]) -> str:
    lines = [
        "| family | model measured | route | attention switched | state | checked against the tests' reference "
        "| exports |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(r.markdown() for r in rows),
    ]
    return "\n".join(lines)


MARKERS = Markers(BEGIN, END, "Hugging Face table")


def replace_table(text: str, new_table: str) -> str:
    return MARKERS.replace(text, new_table)


def main(argv: list[str] | None = None) -> int:
    return table_command(
        argv,
        prog="python -m polyattn_lightning.bench hf-support",
        description=__doc__.split("\n")[0],
        markers=MARKERS,
        measure=lambda keys: table([measure(family(key)) for key in keys] or [measure(f) for f in FAMILIES]),
        subset_help="only these family keys (bert, swin-v2, ...)",
    )


if __name__ == "__main__":
    sys.exit(main())
