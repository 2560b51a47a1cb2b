"""ModernBERT (Warner et al. 2024): transformers' ModernBertForMaskedLM, MLM only."""

import math

import torch
from torch import nn
from transformers import ModernBertConfig, ModernBertForMaskedLM

from mlmlab import choices
from mlmlab.config import ModelConfig
from mlmlab.errors import UserError
from mlmlab.model.architecture import SHAPE, attention_dropout


class ModernBert:
    """ModernBertForMaskedLM: encoder ``model``, MLM head ``head`` then ``decoder`` (tied to the input embeddings).

    No NSP head and no segment embeddings (token_type_ids are not read), as the published model.
    """

    name = choices.MODERNBERT
    label = "ModernBERT"
    loaded_by = "`ModernBertForMaskedLM`"
    positions = "rotary positions and local attention in most layers"
    model_class = ModernBertForMaskedLM
    layer_class = "ModernBertEncoderLayer"
    has_nsp = False
    without_nsp = "its published recipe trains MLM only"  # why it has no NSP head
    # Tuples are paths into nested entries. global_attn_every_n_layers: transformers builds layer_types from
    # it and keeps it in config.json.
    settings = {
        **SHAPE,
        "local_attention": "local_attention",
        "global_attn_every_n_layers": "global_attention_every",
        ("rope_parameters", "full_attention", "rope_theta"): "rope_theta_global",
        ("rope_parameters", "sliding_attention", "rope_theta"): "rope_theta_local",
    }
    own_settings = tuple(setting for setting in settings.values() if setting not in SHAPE.values())
    as_built = {
        "hidden_activation": "gelu",
        "norm_eps": 1e-5,
        "norm_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "decoder_bias": True,
        "classifier_activation": "gelu",
        "tie_word_embeddings": True,
    }
    optional_parts = {}
    unused_parts = ()
    nsp_logits = None

    @staticmethod
    def position_offset(saved: dict) -> int:
        return 0

    @staticmethod
    def forward_flops(cfg: ModelConfig, seq):
        """L * T * (8 H^2 + 6 H I) + 4 H * (attended pairs of every layer): its GeGLU MLP has three H x I
        matrices (two in, one out); a global layer attends T^2 (query, key) pairs, a local one only the pairs
        at most local_attention // 2 apart."""
        h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
        global_layers = math.ceil(layers / cfg.global_attention_every)  # layers 0, n, 2n, ...
        local_pairs = local_attention_pairs(seq, cfg.local_attention // 2)
        pairs = global_layers * seq * seq + (layers - global_layers) * local_pairs
        return layers * seq * (8 * h * h + 6 * h * i) + 4 * h * pairs

    @staticmethod
    def check(cfg: ModelConfig) -> None:
        if (cfg.hidden_size // cfg.num_heads) % 2:
            raise UserError(
                f"ModernBERT's rotary positions rotate pairs of dimensions, so model.hidden_size / "
                f"model.num_heads = {cfg.hidden_size // cfg.num_heads} must be even; change either"
            )

    @staticmethod
    def described(saved: dict) -> str:
        rope = saved["rope_parameters"]
        return (
            "`ModernBertForMaskedLM`: a pre-norm encoder with rotary positions, GeGLU feed-forward and no biases "
            f"but the decoder's; layers 0, {saved['global_attn_every_n_layers']}, ... attend to the whole sequence "
            f"(RoPE base {rope['full_attention']['rope_theta']:,.0f}), the others to {saved['local_attention'] // 2} "
            f"tokens either side (RoPE base {rope['sliding_attention']['rope_theta']:,.0f}); MLM head tied to the "
            "input embeddings; no NSP head."
        )

    @staticmethod
    def config(cfg: ModelConfig, vocab_size: int, pad_token_id: int) -> ModernBertConfig:
        rope = {"full_attention": cfg.rope_theta_global, "sliding_attention": cfg.rope_theta_local}
        return ModernBertConfig(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
            local_attention=cfg.local_attention,
            global_attn_every_n_layers=cfg.global_attention_every,
            rope_parameters={layers: {"rope_type": "default", "rope_theta": theta} for layers, theta in rope.items()},
            **ModernBert.dropout_settings(cfg.dropout, attention_dropout(cfg)),
            pad_token_id=pad_token_id,
            # The released ModernBERT folders' config.json pool by mean for classification (answerdotai's models and
            # their fine-tunes); transformers' default, "cls", would fine-tune ours (`mlmlab glue`) on another head.
            classifier_pooling="mean",
            # The defaults are ids of ModernBERT's own 50k vocabulary, outside ours; the model reads none of them.
            bos_token_id=None,
            eos_token_id=None,
            cls_token_id=None,
            sep_token_id=None,
        )

    @staticmethod
    def dropout_settings(hidden: float, attention: float) -> dict:
        """As BERT's: hidden states (embeddings, MLP and the classifier's input) and attention."""
        return {
            "embedding_dropout": hidden,
            "mlp_dropout": hidden,
            "classifier_dropout": hidden,
            "attention_dropout": attention,
        }

    @staticmethod
    def encode(model, input_ids, attention_mask, token_type_ids=None, inputs_embeds=None) -> tuple:
        out = model.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        return out[0], None  # (B, T, H); no pooler

    @staticmethod
    def predict(model, hidden: torch.Tensor) -> torch.Tensor:
        return model.decoder(model.head(hidden))  # (..., V)

    @staticmethod
    def head_parts(model) -> tuple[nn.Module, nn.Linear]:
        return model.head, model.decoder

    @staticmethod
    def compiled_parts(model) -> tuple[nn.Module, ...]:
        return model.model, model.head, model.decoder

    @staticmethod
    def separate_qkv(model) -> list[nn.Module]:
        return []  # each layer's Wqkv projects Q, K and V in one matmul already


def local_attention_pairs(seq, reach: int):
    """(query, key) pairs of a sequence of ``seq`` tokens at most ``reach`` positions apart.

    Each distance d = 1..m (m = min(reach, seq - 1)) has seq - d pairs in either direction,
    besides the seq pairs of a token with itself: seq + 2 (m seq - m (m + 1) / 2).
    """
    gap = seq - 1
    nearest = (gap + reach - abs(gap - reach)) / 2  # min(seq - 1, reach), for numbers, arrays and tensors alike
    return seq + 2 * nearest * seq - nearest * (nearest + 1)


ARCHITECTURE = ModernBert
