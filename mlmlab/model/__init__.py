"""The model: transformers' encoders behind one adapter each, sparse-prediction pretraining, model folders."""
