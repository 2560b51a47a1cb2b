"""mlmlab: pretrain BERT-style encoders and compare masking strategies."""

__version__ = "0.1.0"
