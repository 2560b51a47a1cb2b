"""BERT (Devlin et al. 2019), the default: transformers' BertForPreTraining, MLM and NSP heads."""

import torch
from torch import nn
from transformers import BertConfig, BertForPreTraining

from mlmlab import choices
from mlmlab.config import ModelConfig
from mlmlab.model.architecture import SHAPE, attention_dropout


class Bert:
    """BertForPreTraining: encoder ``bert``, MLM head ``cls.predictions``, NSP head ``cls.seq_relationship``."""

    name = choices.BERT
    label = "BERT"
    loaded_by = "`BertForPreTraining` (with the NSP head)"  # besides the Auto classes, in the model card
    positions = "learned positions and global attention in every layer"  # why another's attention settings do not apply
    model_class = BertForPreTraining
    layer_class = "BertLayer"  # accelerate's default FSDP wrapping shards per module of this class
    has_nsp = True
    without_nsp = ""
    settings = SHAPE  # config.json entry -> the model.* setting that sets it
    own_settings = ()  # model.* settings no other architecture reads
    as_built = {
        "hidden_act": "gelu",
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "tie_word_embeddings": True,
        "position_embedding_type": "absolute",
    }
    optional_parts = {"bert.pooler.": "pooler", "cls.seq_relationship.": "NSP head"}  # a BertForMaskedLM has neither
    unused_parts = ()

    @staticmethod
    def position_offset(saved: dict) -> int:
        return 0

    @staticmethod
    def forward_flops(cfg: ModelConfig, seq):
        """L * T * (8 H^2 + 4 H I + 4 T H): Q, K, V and output projections; the FFN; QK^T and AV."""
        h, i = cfg.hidden_size, cfg.intermediate_size
        return cfg.num_layers * seq * (8 * h * h + 4 * h * i + 4 * seq * h)

    @staticmethod
    def check(cfg: ModelConfig) -> None:
        """What a model section must satisfy beyond the ranges of its numbers: nothing more for BERT."""

    @staticmethod
    def described(saved: dict) -> str:
        """The model card's sentence on the classes, from the folder's config.json."""
        return "`BertForPreTraining`: encoder, MLM head (tied to the input embeddings) and NSP head."

    @staticmethod
    def config(cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> BertConfig:
        return BertConfig(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
            **Bert.dropout_settings(cfg.dropout, attention_dropout(cfg)),
            pad_token_id=pad_token_id,
        )

    @staticmethod
    def dropout_settings(hidden: float, attention: float) -> dict:
        """The config entries of the dropout on hidden states and on attention."""
        return {"hidden_dropout_prob": hidden, "attention_probs_dropout_prob": attention}

    @staticmethod
    def encode(model, input_ids, attention_mask, token_type_ids, inputs_embeds=None) -> tuple:
        out = model.bert(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            inputs_embeds=inputs_embeds,
        )
        # (B, T, H), (B, H); by name, since a BertForMaskedLM (the benchmarks' anchors) has no pooler and its
        # output tuple then no second entry: evaluate_mlm scores its MLM alone
        return out.last_hidden_state, out.pooler_output

    @staticmethod
    def predict(model, hidden: torch.Tensor) -> torch.Tensor:
        return model.cls.predictions(hidden)  # (..., V)

    @staticmethod
    def head_parts(model) -> tuple[nn.Module, nn.Linear]:
        """The MLM head as (transform, decoder): predict is decoder(transform(hidden))."""
        return model.cls.predictions.transform, model.cls.predictions.decoder

    @staticmethod
    def nsp_logits(model, pooled: torch.Tensor) -> torch.Tensor:
        return model.cls.seq_relationship(pooled)  # (B, 2)

    @staticmethod
    def compiled_parts(model) -> tuple[nn.Module, ...]:
        return model.bert, model.cls.predictions

    @staticmethod
    def separate_qkv(model) -> list[nn.Module]:
        """The self-attention modules that project Q, K and V with three linears (train.fused_qkv fuses them)."""
        return [layer.attention.self for layer in model.bert.encoder.layer]


ARCHITECTURE = Bert
