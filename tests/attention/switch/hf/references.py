"""The tests' own x^3 / sqrt(N) references for the HF families, written independently of the project.

Each is HF's eager code of that family (transformers 5.x), copied with its softmax replaced by :func:`phi`
(``S^3 / sqrt(N)``, N = the keys a query may attend, masked pairs 0, fp64), with the family's own scale and
position terms; they run in the model's dtype (a float64 copy of the model is a float64 reference). Two kinds:

* :func:`attention_reference`, registered with transformers under :data:`REFERENCE` (``AttentionInterface``,
  boolean masks from ``sdpa_mask``): the generic eager function (``repeat_kv``, ``S = q k^T * scaling``), plus
  what some families add: T5's ``position_bias``, Gemma 2's ``softcap``, GPT-OSS's and Inkling 2's sinks (for
  poly3 the meaning the switch defines: a key with value 0, so N counts it), BEiT's and Doge's float masks (a
  score bias, ``finfo.min`` where masked), Falcon's from transformers 5.25 on (``alibi / sqrt(d)``, taken in its
  relative form for poly3, ``finfo.min`` where masked); a float mask of any other model masks where it is not 0. Models
  without SDPA support get HF's float eager masks (:data:`REFERENCE_EAGER_MASKS`), as HF runs them;
* class swaps (:data:`SWAPS`): a subclass of the HF attention class whose ``forward`` is HF's eager forward
  with ``phi``, for the families outside the interface and for Swin (whose bias and shift mask are apart only
  inside its forward), reading HF's own helpers (DeBERTa's c2p / p2c terms, RoFormer's rotation, the position
  biases) and HF's eager masks as HF adds them (0 keeps; ``finfo.min`` or Swin V2's -100 masks); cross attention
  where HF's has it, no cache (a reference runs over the whole sequence); and PyTorch's ``nn.MultiheadAttention``
  written from ``F.multi_head_attention_forward``. :func:`reference_twin` gives a copy of a model attending
  through these.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.beit.modeling_beit import BeitAttention
from transformers.models.bloom import modeling_bloom as bloom
from transformers.models.data2vec import modeling_data2vec_vision as d2v
from transformers.models.deberta import modeling_deberta as deberta
from transformers.models.deberta_v2 import modeling_deberta_v2 as deberta_v2
from transformers.models.doge.modeling_doge import DogeAttention
from transformers.models.falcon import modeling_falcon as falcon
from transformers.models.gpt_neo import modeling_gpt_neo as gpt_neo
from transformers.models.megatron_bert import modeling_megatron_bert as megatron
from transformers.models.mpnet import modeling_mpnet as mpnet
from transformers.models.rembert import modeling_rembert as rembert
from transformers.models.roformer import modeling_roformer as roformer
from transformers.models.swin import modeling_swin as swin
from transformers.models.swinv2 import modeling_swinv2 as swinv2
from transformers.models.tapas import modeling_tapas as tapas
from transformers.models.visual_bert import modeling_visual_bert as visual_bert

REFERENCE = "tests_poly3_reference"
#: The same function with HF's float eager masks, for models without SDPA support (as HF runs them).
REFERENCE_EAGER_MASKS = "tests_poly3_reference_eager_masks"


def phi(scores, keep, extra_keys: int = 0):
    """``S^3 / sqrt(N)`` where ``keep``, 0 elsewhere, fp64; N = kept keys of the row (+ ``extra_keys``)."""
    scores = scores.double()
    keep = keep.expand(scores.shape)
    n = keep.sum(-1, keepdim=True).double() + extra_keys
    return torch.where(keep, scores**3, 0.0) / n.clamp_min(1).sqrt()


def attention_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The generic eager attention with :func:`phi`; HF's ``(output (B, L, H, D), None)``."""
    q, k, v = query.double(), key.double(), value.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if kwargs.get("softcap") is not None:
        scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
    if kwargs.get("position_bias") is not None:
        scores = scores + kwargs["position_bias"].double()
    nq, nk = scores.shape[-2:]
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if attention_mask is None:
        if getattr(module, "is_causal", True) and nq > 1:
            keep = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    elif attention_mask.dtype == torch.bool:
        keep = attention_mask
    elif isinstance(module, (BeitAttention, DogeAttention)):  # a bias as the mask: BEiT's position bias, Doge's
        keep = attention_mask > torch.finfo(attention_mask.dtype).min
        scores = scores + torch.where(keep, attention_mask.double(), 0.0)
    elif isinstance(module, falcon.FalconAttention):  # transformers >= 5.25: alibi / sqrt(d), finfo.min where masked
        keep = attention_mask > torch.finfo(attention_mask.dtype).min
        scores = scores + relative_rows(torch.where(keep, attention_mask.double(), 0.0))
    else:
        keep = attention_mask == 0
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    out = phi(scores, keep, extra_keys=0 if sinks is None else 1) @ v  # a sink: one more key, of value 0
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(REFERENCE, attention_reference)
AttentionMaskInterface.register(REFERENCE, sdpa_mask)
AttentionInterface.register(REFERENCE_EAGER_MASKS, attention_reference)
AttentionMaskInterface.register(REFERENCE_EAGER_MASKS, eager_mask)


def _heads(x, d):
    return x.view(*x.shape[:-1], -1, d).transpose(1, 2)


def _merge(x, dtype=torch.float32):
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1).to(dtype)


def _kept(mask):
    """An HF model's own mask (or None, nothing masked): True where it lets a pair attend, as HF's eager code adds
    it to the scores (0 keeps; ``finfo.min``, or Swin's -100, masks)."""
    if mask is None:
        return torch.ones(1, dtype=torch.bool)
    return mask == 0 if mask.is_floating_point() else mask.bool()


def _context(scores, keep, value):
    """``phi(S) v`` ``(B, H, L, d)`` merged to ``(B, L, H * d)`` in ``value``'s dtype (float64 in a float64 twin)."""
    return _merge(phi(scores, keep) @ value.double(), value.dtype)


class RefSwinAttention(swin.SwinAttention):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        q, k, v = (_heads(p(hidden_states), self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) * self.scaling + self.relative_position_bias()
        keep = torch.ones(1, dtype=torch.bool)
        if attention_mask is not None:  # (windows, N, N): 0 keeps, -100 masks
            keep = (attention_mask == 0).repeat(input_shape[0] // attention_mask.shape[0], 1, 1).unsqueeze(1)
        out = phi(scores, keep) @ v.double()
        return self.o_proj(_merge(out)), None


class RefDebertaAttention(deberta.DisentangledSelfAttention):
    def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None, relative_pos=None,
                rel_embeddings=None):
        if query_states is not None:  # HF's own path transposes a (B, L, E) tensor with .t(): it runs for no model
            raise NotImplementedError("DeBERTa's query_states")
        q, k, v = self.transpose_for_scores(self.in_proj(hidden_states)).chunk(3, dim=-1)
        q = q + self.transpose_for_scores(self.q_bias[None, None, :])
        v = v + self.transpose_for_scores(self.v_bias[None, None, :])
        scale_factor = 1 + len(self.pos_att_type)
        q = q / deberta.scaled_size_sqrt(q, scale_factor).to(dtype=q.dtype)
        scores = q @ k.transpose(-1, -2)
        if self.relative_attention and rel_embeddings is not None and relative_pos is not None:
            scores = scores + self.disentangled_att_bias(q, k, relative_pos, self.pos_dropout(rel_embeddings),
                                                         scale_factor)
        return _context(scores, attention_mask.bool(), v), None


class RefDebertaV2Attention(deberta_v2.DisentangledSelfAttention):
    def forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None, relative_pos=None,
                rel_embeddings=None):
        h = self.num_attention_heads
        q = self.transpose_for_scores(self.query_proj(hidden_states if query_states is None else query_states), h)
        k = self.transpose_for_scores(self.key_proj(hidden_states), h)
        v = self.transpose_for_scores(self.value_proj(hidden_states), h)
        scale_factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
        scale = deberta_v2.scaled_size_sqrt(q, scale_factor)
        scores = torch.bmm(q, k.transpose(-1, -2) / scale.to(dtype=q.dtype))
        if self.relative_attention:
            scores = scores + self.disentangled_attention_bias(q, k, relative_pos, self.pos_dropout(rel_embeddings),
                                                               scale_factor)
        scores = scores.view(-1, h, scores.size(-2), scores.size(-1))
        return _context(scores, attention_mask.bool(), v.view(-1, h, *v.shape[1:])), None


class RefMPNetAttention(mpnet.MPNetSelfAttention):
    def forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
        d = self.attention_head_size
        q, k, v = (_heads(p(hidden_states), d) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if position_bias is not None:
            scores = scores + position_bias
        return (self.o(_context(scores, _kept(attention_mask), v)),)


class RefRoFormerAttention(roformer.RoFormerSelfAttention):
    def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, encoder_hidden_states=None,
                cache=None, output_attentions=False, **kwargs):
        assert cache is None, "the reference runs without a cache"
        d = self.attention_head_size
        states = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = _heads(self.query(hidden_states), d), _heads(self.key(states), d), _heads(self.value(states), d)
        if encoder_hidden_states is None and sinusoidal_pos is not None:  # rotary in self-attention only
            if self.rotary_value:
                q, k, v = self.apply_rotary_position_embeddings(sinusoidal_pos, q, k, v)
            else:
                q, k = self.apply_rotary_position_embeddings(sinusoidal_pos, q, k)
        return _context(q @ k.transpose(-1, -2) / math.sqrt(d), _kept(attention_mask), v), None


def _bert_eager_context(module, hidden_states, attention_mask, encoder_hidden_states=None, cache=None):
    """BERT's attention as these HF copies write it; cross attention takes k, v from the encoder's states (of
    their own length: Megatron-BERT's and TAPAS's views assume the decoder's)."""
    assert cache is None, "the reference runs without a cache"
    d = module.attention_head_size
    states = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    q, k, v = _heads(module.query(hidden_states), d), _heads(module.key(states), d), _heads(module.value(states), d)
    return _context(q @ k.transpose(-1, -2) / math.sqrt(d), _kept(attention_mask), v)


class RefMegatronBertAttention(megatron.MegatronBertSelfAttention):
    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None,
                output_attentions=False, **kwargs):
        return _bert_eager_context(self, hidden_states, attention_mask, encoder_hidden_states, cache), None


class RefRemBertAttention(rembert.RemBertSelfAttention):
    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None,
                output_attentions=False, **kwargs):
        return _bert_eager_context(self, hidden_states, attention_mask, encoder_hidden_states, cache), None


class RefTapasAttention(tapas.TapasSelfAttention):
    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None,
                output_attentions=False, **kwargs):
        context = _bert_eager_context(self, hidden_states, attention_mask, encoder_hidden_states, cache)
        return (context, cache) if self.is_decoder else (context,)


class RefVisualBertAttention(visual_bert.VisualBertSelfAttention):
    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        return (_bert_eager_context(self, hidden_states, attention_mask),)


class RefData2VecVisionAttention(d2v.Data2VecVisionSelfAttention):
    def forward(self, hidden_states, output_attentions=False, relative_position_bias=None,
                interpolate_pos_encoding=False, resolution=None):
        d = self.attention_head_size
        q, k, v = (_heads(p(hidden_states), d) for p in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if self.has_relative_position_bias:
            height, width = resolution
            window_size = (height // self.config.patch_size, width // self.config.patch_size)
            scores = scores + self.relative_position_bias(window_size, interpolate_pos_encoding,
                                                          dim_size=hidden_states.shape[1])
        if relative_position_bias is not None:
            scores = scores + relative_position_bias
        return (_context(scores, _kept(None), v),)


class RefSwinv2Attention(swinv2.Swinv2SelfAttention):
    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        batch_size, dim, _ = hidden_states.shape
        d = self.attention_head_size
        q, k, v = (_heads(p(hidden_states), d) for p in (self.query, self.key, self.value))
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        scores = scores * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        table = self.continuous_position_bias_mlp(self.relative_coords_table).view(-1, self.num_attention_heads)
        bias = table[self.relative_position_index.view(-1)].view(dim, dim, -1).permute(2, 0, 1)
        scores = scores + 16 * torch.sigmoid(bias).unsqueeze(0)
        keep = _kept(None)
        if attention_mask is not None:  # (windows, N, N), 0 or -100 (added twice); row b * windows + w is window w
            windows = attention_mask.shape[0]
            keep = _kept(attention_mask).unsqueeze(1).unsqueeze(0).expand(batch_size // windows, -1, -1, -1, -1)
            keep = keep.reshape(-1, 1, dim, dim)
        return (_context(scores, keep, v),)


class RefGPTNeoAttention(gpt_neo.GPTNeoSelfAttention):
    def _attn(self, query, key, value, attention_mask=None):
        scores = query.double() @ key.double().transpose(-1, -2)  # no 1/sqrt(d), as GPT-Neo
        nq, nk = query.size(-2), key.size(-2)
        keep = self.bias[:, :, nk - nq : nk, :nk]
        if attention_mask is not None:
            keep = keep & _kept(attention_mask)
        return (phi(scores, keep) @ value.double()).to(value.dtype), None


def relative_rows(bias):
    """ALiBi in its relative form from a bias per row ``(B, H, Q, K)`` (HF's ``slope * position_j`` in every row):
    each row minus its value at the query's own key, ``i + K - Q``."""
    own = torch.diagonal(bias, offset=bias.shape[-1] - bias.shape[-2], dim1=-2, dim2=-1)
    return bias - own[..., None]


def relative(alibi, num_queries):
    """ALiBi in its relative form: ``slope * (position_j - position_i)`` from HF's ``slope * position_j``
    ``(B, H, 1, K)``: query i is key ``i + K - Q``."""
    per_key = alibi[:, :, 0, :]
    return per_key[:, :, None, :] - per_key[:, :, -num_queries:, None]


#: transformers 5.25 moved Falcon onto the AttentionInterface (its model adds ALiBi into the mask); 5.24's
#: FalconAttention computes attention itself (and takes ``alibi``).
FALCON_THROUGH_THE_INTERFACE = Version(transformers.__version__) >= Version("5.25")


class RefFalconAttention(falcon.FalconAttention):
    """transformers 5.24's FalconAttention (its SDPA path)."""

    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        heads, d = self.num_heads, self.head_dim
        kv_heads = heads if self.new_decoder_architecture else self.num_kv_heads
        q, k, v = self._split_heads(self.query_key_value(hidden_states))
        batch, length = q.shape[:2]
        q = q.transpose(1, 2).reshape(batch, heads, length, d)
        k, v = (x.transpose(1, 2).reshape(batch, kv_heads, length, d) for x in (k, v))
        if alibi is None:
            q, k = falcon.apply_rotary_pos_emb(q, k, *position_embeddings)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if alibi is not None:
            scores = scores + relative(alibi.view(batch, heads, 1, -1), length) / math.sqrt(d)
        keep = attention_mask > torch.finfo(attention_mask.dtype).min if attention_mask.is_floating_point() \
            else attention_mask
        out = phi(scores, keep) @ v.double()
        return self.dense(_merge(out)), None


class RefBloomAttention(bloom.BloomAttention):
    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        assert layer_past is None, "the reference runs without a cache"
        batch, length, _ = hidden_states.shape
        q, k, v = self._reshape(self.query_key_value(hidden_states))
        scores = q @ k.transpose(-1, -2) * self.inv_norm_factor
        scores = scores + self.beta * relative(alibi.view(batch, self.num_heads, 1, -1), length)
        context = _context(scores, _kept(attention_mask), v)
        if self.pretraining_tp > 1 and self.slow_but_exact:  # HF's slices of the output projection, without its bias
            width = self.hidden_size // self.pretraining_tp
            parts = [slice(i * width, (i + 1) * width) for i in range(self.pretraining_tp)]
            output = sum(F.linear(context[..., part], self.dense.weight[:, part]) for part in parts)
        else:
            output = self.dense(context)
        return bloom.dropout_add(output, residual, self.hidden_dropout, self.training), None


def _added(mask, dtype):
    """A mask as ``F.multi_head_attention_forward`` adds it to the scores, in ``dtype``: a bool one ``-inf`` where
    True, a float one as it is, with ``finfo.min`` read as ``-inf`` (the meaning the project gives it)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, -math.inf)
    return mask.to(dtype).masked_fill(mask <= torch.finfo(mask.dtype).min, -math.inf)


class RefMultiheadAttention(nn.MultiheadAttention):
    """``F.multi_head_attention_forward``'s steps (torch 2.x, in its layout: ``(L, B, E)``, heads in the batch axis)
    with :func:`phi` where the softmax was: the packed or separate (``kdim``/``vdim``) projections, ``bias_k`` /
    ``bias_v`` and the zero key of ``add_zero_attn`` appended, the masks added to the scores (``-inf`` entries
    masked, the rest a score bias), ``batch_first`` or not, unbatched inputs, the weights as PyTorch returns them."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal is a hint: attn_mask is needed")
        batched = query.dim() == 3
        if not batched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        tgt_len, bsz, embed_dim = query.shape
        heads, head_dim, dtype = self.num_heads, self.head_dim, query.dtype
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
        mask = None if attn_mask is None else _added(attn_mask, dtype)
        padding = None if key_padding_mask is None else _added(key_padding_mask, dtype)
        if mask is not None:
            mask = mask.unsqueeze(0) if mask.dim() == 2 else mask
        if self.bias_k is not None:
            k, v = torch.cat([k, self.bias_k.repeat(1, bsz, 1)]), torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            mask = None if mask is None else F.pad(mask, (0, 1))
            padding = None if padding is None else F.pad(padding, (0, 1))
        q = q.view(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            k = torch.cat([k, torch.zeros(bsz * heads, 1, head_dim, dtype=k.dtype)], dim=1)
            v = torch.cat([v, torch.zeros(bsz * heads, 1, head_dim, dtype=v.dtype)], dim=1)
            mask = None if mask is None else F.pad(mask, (0, 1))
            padding = None if padding is None else F.pad(padding, (0, 1))
        src_len = k.size(1)
        if padding is not None:
            padding = padding.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
            mask = padding if mask is None else mask + padding
        scores = (q * head_dim**-0.5) @ k.transpose(-2, -1)
        keep = torch.ones(1, dtype=torch.bool) if mask is None else mask > -math.inf
        if mask is not None:
            scores = scores + torch.where(keep, mask, 0.0)
        weights = phi(scores, keep).to(dtype)
        out = (weights @ v).transpose(0, 1).contiguous().view(tgt_len * bsz, embed_dim)
        out = self.out_proj(out).view(tgt_len, bsz, embed_dim)
        weights = weights.view(bsz, heads, tgt_len, src_len)
        weights = weights.mean(dim=1) if average_attn_weights else weights
        if not batched:
            return out.squeeze(1), weights.squeeze(0) if need_weights else None
        return out.transpose(1, 0) if self.batch_first else out, weights if need_weights else None


#: HF class -> its reference subclass, for the families the interface does not reach (and Swin).
SWAPS = {
    swin.SwinAttention: RefSwinAttention,
    deberta.DisentangledSelfAttention: RefDebertaAttention,
    deberta_v2.DisentangledSelfAttention: RefDebertaV2Attention,
    mpnet.MPNetSelfAttention: RefMPNetAttention,
    roformer.RoFormerSelfAttention: RefRoFormerAttention,
    megatron.MegatronBertSelfAttention: RefMegatronBertAttention,
    rembert.RemBertSelfAttention: RefRemBertAttention,
    tapas.TapasSelfAttention: RefTapasAttention,
    visual_bert.VisualBertSelfAttention: RefVisualBertAttention,
    d2v.Data2VecVisionSdpaSelfAttention: RefData2VecVisionAttention,
    d2v.Data2VecVisionSelfAttention: RefData2VecVisionAttention,
    swinv2.Swinv2SelfAttention: RefSwinv2Attention,
    gpt_neo.GPTNeoSelfAttention: RefGPTNeoAttention,
    **({} if FALCON_THROUGH_THE_INTERFACE else {falcon.FalconAttention: RefFalconAttention}),
    bloom.BloomAttention: RefBloomAttention,
    nn.MultiheadAttention: RefMultiheadAttention,
}


def reference_twin(model):
    """A copy of ``model`` (same weights) attending through the references: swapped classes where HF computes
    attention itself, the registered reference function everywhere else."""
    twin = copy.deepcopy(model)
    if type(twin)._can_set_attn_implementation():
        twin.set_attn_implementation(REFERENCE if type(twin)._supports_sdpa else REFERENCE_EAGER_MASKS)
    for module in twin.modules():
        if type(module) in SWAPS:
            module.__class__ = SWAPS[type(module)]
    return twin
