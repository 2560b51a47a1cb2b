"""RoBERTa (Liu et al. 2019): transformers' RobertaForMaskedLM, BERT's encoder trained by MLM alone."""

from __future__ import annotations

import torch
from torch import nn
from transformers import RobertaConfig, RobertaForMaskedLM, XLMRobertaConfig

from mlmlab import choices
from mlmlab.config import ModelConfig
from mlmlab.model.architecture import SHAPE, attention_dropout
from mlmlab.model.architectures.bert import Bert


class _RobertaTransform(nn.Module):
    """RobertaLMHead's transform (dense, GELU, LayerNorm) as one module: the head is decoder(transform(hidden))."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.layer_norm(nn.functional.gelu(self.head.dense(hidden)))


class Roberta:
    """RobertaForMaskedLM: encoder ``roberta``, MLM head ``lm_head`` (decoder tied to the input embeddings).

    BERT's post-LayerNorm encoder as RoBERTa trains it: MLM only (no NSP head), one token type (token_type_ids
    are not passed), and positions counted from past the padding id (fairseq's make_positions), so a model of
    T tokens has T + pad_token_id + 1 position rows, as the released roberta-base's 514 for 512 tokens.
    """

    name = choices.ROBERTA
    label = "RoBERTa"
    loaded_by = "`RobertaForMaskedLM`"
    positions = Bert.positions
    model_class = RobertaForMaskedLM
    config_class = RobertaConfig
    layer_class = "RobertaLayer"
    has_nsp = False
    without_nsp = "it drops NSP and trains MLM on full sentences"
    settings = SHAPE
    own_settings = ()
    forward_flops = Bert.forward_flops  # BERT's encoder
    check = Bert.check
    as_built = {
        "hidden_act": "gelu",
        "type_vocab_size": 1,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "position_embedding_type": "absolute",
    }
    optional_parts = {}
    unused_parts = ("roberta.pooler.",)  # released RoBERTa folders hold a pooler RobertaForMaskedLM does not read
    nsp_logits = None

    @staticmethod
    def position_offset(saved: dict) -> int:
        """Position rows before the first token's: ids start at pad_token_id + 1."""
        return (saved.get("pad_token_id") or 0) + 1

    @classmethod
    def described(cls, saved: dict) -> str:
        return (
            f"{cls.loaded_by}: BERT's post-LayerNorm encoder with one token type and learned positions "
            "counted from past the padding id; MLM head tied to the input embeddings; no NSP head."
        )

    @classmethod
    def config(cls, cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> RobertaConfig | XLMRobertaConfig:
        return cls.config_class(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings + pad_token_id + 1,
            type_vocab_size=1,
            layer_norm_eps=1e-5,
            **Bert.dropout_settings(cfg.dropout, attention_dropout(cfg)),
            pad_token_id=pad_token_id,
            # RoBERTa's defaults (0, 2) are ids of its own vocabulary; the model reads neither.
            bos_token_id=None,
            eos_token_id=None,
        )

    dropout_settings = Bert.dropout_settings

    @staticmethod
    def encode(model, input_ids, attention_mask, token_type_ids=None, inputs_embeds=None) -> tuple:
        out = model.roberta(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        return out[0], None  # (B, T, H); no pooler

    @staticmethod
    def predict(model, hidden: torch.Tensor) -> torch.Tensor:
        return model.lm_head(hidden)  # (..., V)

    @staticmethod
    def head_parts(model) -> tuple[nn.Module, nn.Linear]:
        return _RobertaTransform(model.lm_head), model.lm_head.decoder

    @staticmethod
    def compiled_parts(model) -> tuple[nn.Module, ...]:
        return model.roberta, model.lm_head

    @staticmethod
    def separate_qkv(model) -> list[nn.Module]:
        return [layer.attention.self for layer in model.roberta.encoder.layer]


ARCHITECTURE = Roberta
