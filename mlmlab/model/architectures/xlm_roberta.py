"""XLM-R (Conneau et al. 2020): RoBERTa's architecture under transformers' XLMRobertaForMaskedLM."""

from transformers import XLMRobertaConfig, XLMRobertaForMaskedLM

from mlmlab import choices
from mlmlab.model.architectures.roberta import Roberta


class XlmRoberta(Roberta):
    """XLMRobertaForMaskedLM: RoBERTa's architecture under XLM-R's class names (Conneau et al. 2020), the same
    modules and weight names (``roberta``, ``lm_head``), so that a released XLM-R folder, whose config.json says
    model_type "xlm-roberta", continues as the class it was saved as. Its SentencePiece Unigram vocabulary is the
    tokenizer's (data/tokenizer.py), not the adapter's.
    """

    name = choices.XLM_ROBERTA
    label = "XLM-R"
    loaded_by = "`XLMRobertaForMaskedLM`"
    model_class = XLMRobertaForMaskedLM
    config_class = XLMRobertaConfig
    layer_class = "XLMRobertaLayer"

    @classmethod
    def described(cls, saved: dict) -> str:
        return f"{super().described(saved)} XLM-R's class for RoBERTa's architecture."


ARCHITECTURE = XlmRoberta
