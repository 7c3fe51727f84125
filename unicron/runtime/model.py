"""A real Megatron-core ``GPTModel`` that trains on CPU with gloo (and on a GPU with NCCL).

Megatron's default core attention needs its CUDA memory buffer, and its DDP, optimizer and pipeline
schedules need CUDA; the model itself does not. We build ``GPTModel`` from
``get_gpt_layer_local_spec()`` with the core-attention submodule replaced by :class:`SDPAttention`
(torch's ``scaled_dot_product_attention``), CPU initialisation and the CUDA fusions off. Process
groups are passed explicitly (``pg_collection``), never through ``parallel_state``, so the runtime can
swap them when it re-forms groups (:func:`rebind_groups`).

Tensor parallelism: weights are initialised as full master weights and split (Megatron's CPU path),
so a TP=2 model holds exactly the shards of the TP=1 model built from the same seed. The loss
(:func:`lm_loss`) is a vocabulary-parallel cross-entropy over our TP group, equal to the TP=1 loss up
to rounding.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from unicron.kernel.errors import ConfigError
from unicron.runtime.comm import CommGroup, allreduce_max, solo_group

with warnings.catch_warnings():
    # Megatron warns at import that Transformer Engine / Apex are absent: expected on CPU.
    warnings.simplefilter("ignore")
    from megatron.core.enums import ModelType as ModelType  # (re-exported: pretrain's model_type)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    """Size of the GPT and its numeric type."""

    #: transformer layers
    layers: int = 2
    #: hidden size
    hidden: int = 128
    #: attention heads (must divide hidden, and be divisible by tp)
    heads: int = 4
    #: sequence length
    seq: int = 64
    #: vocabulary size (must be divisible by tp)
    vocab: int = 128
    #: parameter dtype: float32, float64 or bfloat16
    dtype: str = "float32"
    #: dropout probability in attention and hidden layers (0 keeps runs comparable bit for bit)
    dropout: float = 0.0
    #: seed of the parameter initialisation (identical on every replica)
    init_seed: int = 1234

    def validate(self, tp: int) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.hidden % self.heads:
            raise ConfigError(f"--heads {self.heads} must divide --hidden {self.hidden}")
        if self.heads % tp or self.vocab % tp or (4 * self.hidden) % tp:
            raise ConfigError(f"--tp {tp} must divide --heads ({self.heads}) and --vocab ({self.vocab})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class SDPAttention(MegatronModule):  # type: ignore[misc]
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Same contract as Megatron's ``DotProductAttention``: query ``[sq, b, np, hn]``, key/value
    ``[sk, b, ng, hn]`` in, context ``[sq, b, np*hn]`` out, for this rank's heads.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            raise ConfigError("SDPAttention needs an explicit pg_collection (tp group)")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ConfigError("SDPAttention supports neither attention_bias nor packed sequences")
        sq, b, heads, hn = query.shape
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if k.size(1) != heads:  # grouped-query attention: repeat key/value groups
            k = k.repeat_interleave(heads // k.size(1), dim=1)
            v = v.repeat_interleave(heads // v.size(1), dim=1)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        # Megatron masks are True where attention is forbidden; SDPA's boolean masks are the opposite.
        mask = None if attention_mask is None else ~attention_mask.bool()
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def pg_collection(tp_group: CommGroup) -> ProcessGroupCollection:
    solo = solo_group()
    return ProcessGroupCollection(
        tp=tp_group, pp=solo, mp=tp_group, embd=solo, pos_embd=solo, cp=solo, tp_cp=tp_group,
        dp=solo, dp_cp=solo,
    )


def transformer_config(cfg: ModelConfig, tp: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=cfg.torch_dtype,
        pipeline_dtype=cfg.torch_dtype, attention_dropout=cfg.dropout, hidden_dropout=cfg.dropout,
        # The fused kernels are CUDA-only.
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
    )


def build_gpt(cfg: ModelConfig, tp_group: CommGroup) -> GPTModel:
    """The GPT, on CPU, identical on every replica (same init seed)."""
    tp = tp_group.size()
    cfg.validate(tp)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    torch.manual_seed(cfg.init_seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(
            config=transformer_config(cfg, tp), transformer_layer_spec=spec, vocab_size=cfg.vocab,
            max_sequence_length=cfg.seq, parallel_output=True, pg_collection=pg_collection(tp_group),
        )
    # Megatron's local LayerNorm ignores params_dtype; make every parameter the configured dtype.
    return model.to(cfg.torch_dtype)


def lm_loss(model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor, tp_group: CommGroup) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch over vocabulary-split logits.

    Megatron's own vocab-parallel cross-entropy reads the TP group from ``parallel_state`` and its
    logit gather allocates on CUDA, so the loss is taken here: the same log-sum-exp formula for any
    TP size, its two sums all-reduced over ``tp_group`` (backward: identity, as in Megatron).
    """
    position_ids = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, position_ids, None)  # [b, s, vocab/tp]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # reduced-precision logits: take the loss in float32
    part = logits.size(-1)
    start = tp_group.rank() * part
    with torch.no_grad():
        peak = logits.max(dim=-1, keepdim=True).values
        if tp_group.size() > 1:
            allreduce_max(tp_group, peak)
    shifted = logits - peak
    sum_exp = shifted.exp().sum(dim=-1)
    local = labels - start
    inside = (local >= 0) & (local < part)
    target = torch.gather(shifted, -1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * inside
    if tp_group.size() > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=tp_group)
        target = reduce_from_tensor_model_parallel_region(target, group=tp_group)
    loss: torch.Tensor = (sum_exp.log() - target).mean()
    return loss


def tp_group_of(model: torch.nn.Module) -> CommGroup:
    """The tensor-parallel group a Megatron-core model was built on (its ``pg_collection``), which
    :func:`rebind_groups` keeps current: what a forward step passes to :func:`lm_loss`."""
    pgc = vars(model).get("pg_collection")
    if not isinstance(pgc, ProcessGroupCollection):
        raise ConfigError(f"{type(model).__name__} holds no pg_collection: build it with pg_collection=")
    group: CommGroup = pgc.tp
    return group


def rebind_groups(model: torch.nn.Module, old: CommGroup, new: CommGroup) -> int:
    """Point every reference to ``old`` inside ``model`` (module attributes and their
    ProcessGroupCollections) at ``new``; returns how many were replaced. Used when a replica's
    tensor-parallel group is re-formed in place."""
    replaced = 0
    seen: set[int] = set()
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if value is old:
                setattr(module, name, new)
                replaced += 1
            elif isinstance(value, ProcessGroupCollection) and id(value) not in seen:
                seen.add(id(value))
                for field_name, field_value in list(vars(value).items()):
                    if field_value is old:
                        setattr(value, field_name, new)
                        replaced += 1
    return replaced
