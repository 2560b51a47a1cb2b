"""The model: transformers' encoders behind one adapter each, pretrained with sparse prediction, saved as folders.

architecture.py (the ``Architecture`` interface), architectures/ (one module per architecture, and what asks
them), pretraining.py (building a model, loading weights, the sparse MLM + NSP loss), folder.py (a model folder
written, checked, loaded), flops.py (the FLOP model MFU and budgets share), head_loss.py and fused_qkv.py (the
train.fused_* levers).
"""
