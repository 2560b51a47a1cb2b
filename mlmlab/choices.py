"""The named choices of the config, each set defined once.

Everything else imports these: config validation, the implementations (which key their
tables by these constants), the CLI's ``choices=``, budgets and reports. A new schedule or
objective is added here first; a new masking strategy or scorer also needs its entry
(masking/strategies.py, masking/scorers.py).
"""

# model.architecture: each is transformers' model_type of the class it builds (a saved config.json says which);
# what each one is lives in its module of model/architectures/, whose add_architecture appends a new one's name
BERT = "bert"  # the seed's: BertForPreTraining, post-LayerNorm, learned positions, MLM + NSP heads
MODERNBERT = "modernbert"  # ModernBertForMaskedLM: pre-norm, RoPE, GeGLU, no biases, local/global attention; MLM only
ROBERTA = "roberta"  # RobertaForMaskedLM: BERT's encoder, positions past the padding id, one token type; MLM only
XLM_ROBERTA = "xlm-roberta"  # XLMRobertaForMaskedLM: RoBERTa's architecture under XLM-R's class names; MLM only
ARCHITECTURES = [BERT, ROBERTA, XLM_ROBERTA, MODERNBERT]  # model/architectures/: one module each

# mlmlab tokenizer --kind: the tokenizers library's models, each saved so that AutoTokenizer loads it
WORDPIECE = "wordpiece"  # BERT's: "##" marks a word's continuation pieces; [CLS] [SEP] [PAD] [UNK] [MASK]
BPE = "bpe"  # RoBERTa's (GPT-2's) byte-level BPE: "Ġ" marks a word's first piece; <s> </s> <pad> <unk> <mask>
UNIGRAM = "unigram"  # SentencePiece's Unigram: "▁" marks a word's first piece; XLM-R's <s> </s> <pad> <unk> <mask>
TOKENIZER_KINDS = (WORDPIECE, BPE, UNIGRAM)

# masking.strategy and masking.scorer: only the names, so that the config can refuse an unknown one when it is
# built; what each one is and costs is its entry beside its implementation (masking/strategies.py, scorers.py),
# whose add_strategy / add_scorer append a new one's name to these lists.
STATIC = "static"  # BERT: dupe_factor fixed masks per example, cycled over epochs
DYNAMIC = "dynamic"  # RoBERTa: new masks every epoch
ADAPTIVE = "adaptive"  # ADM: weights from the model's uncertainty
SPAN = "span"  # SpanBERT: spans of whole words, geometric lengths
PMI = "pmi"  # PMI-Masking: n-grams whose words co-occur far above chance, else single words
STRATEGIES = [STATIC, DYNAMIC, ADAPTIVE, SPAN, PMI]

ENTROPY = "entropy"
MAX_PROB = "max_prob"
GRAD_NORM = "grad_norm"
LOSS_EMA = "loss_ema"
CONTEXT = "context"
FREQUENCY = "frequency"  # control: -log unigram probability; does uncertainty add anything beyond frequency?
SCORERS = [ENTROPY, MAX_PROB, GRAD_NORM, LOSS_EMA, CONTEXT, FREQUENCY]

# masking.adapt_schedule: the shape f of ADM's a = a_max * f(progress)
QUADRATIC = "quadratic"
LINEAR = "linear"
COSINE = "cosine"
ONE_MINUS_SQRT = "1-sqrt"  # Hägele et al. 2024's cooldown, ModernBERT's LR decay
EXPONENTIAL = "exponential"
SIGMOID = "sigmoid"
CONSTANT = "constant"  # also a rate schedule: the mask rate stays masking.rate
ADAPT_SCHEDULES = (QUADRATIC, LINEAR, COSINE, EXPONENTIAL, SIGMOID, CONSTANT)

# masking.rate_schedule
LINEAR_DECAY = "linear_decay"  # Ankner et al. 2024: from rate_start down to rate
RATE_SCHEDULES = (CONSTANT, LINEAR_DECAY)

# train.lr_schedule: the shape of the LR's decay after warmup (over the last train.decay_fraction)
LR_SCHEDULES = (LINEAR, COSINE, ONE_MINUS_SQRT)  # linear: BERT's, and warmup-stable-decay; cosine: the seed's
# RoBERTa setting; 1-sqrt: ModernBERT's (Warner et al. 2024), from Hägele et al. 2024's warmup-stable-decay study

# train.optimizer
ADAMW = "adamw"  # torch's AdamW (BERT's, RoBERTa's)
STABLE_ADAMW = "stable-adamw"  # AdamW with update clipping per tensor (Wortsman et al. 2023): ModernBERT's
OPTIMIZERS = (ADAMW, STABLE_ADAMW)

# masking.normalize
MEAN = "mean"
RAW = "raw"
NORMALIZATIONS = (MEAN, RAW)

# data.objective
NSP = "nsp"  # sentence pairs, loss = MLM + NSP
MLM = "mlm"  # packed full sentences, MLM only
OBJECTIVES = (NSP, MLM)

# train.precision
AUTO = "auto"
FP32 = "fp32"
BF16 = "bf16"
FP16 = "fp16"
PRECISIONS = (AUTO, FP32, BF16, FP16)

# probe pooling (evaluate.linear_probe): how a sentence's final hidden states become one feature vector
MEAN_POOLING = "mean"  # the mean over the real tokens (padding excluded)
CLS_POOLING = "cls"  # the [CLS] position's state
POOLINGS = (MEAN_POOLING, CLS_POOLING)

# a study's budget
TOKEN_MATCHED = "token-matched"  # every arm sees as many sequences as the baseline
COMPUTE_MATCHED = "compute-matched"  # every arm spends the baseline's FLOPs, scoring included
BUDGETS = (TOKEN_MATCHED, COMPUTE_MATCHED)


# train.report_to, comma-separated: "tensorboard" is mlmlab's own writer (train/metrics.py), "none" writes only
# metrics.jsonl; the rest are accelerate's trackers under accelerate's names (train/trackers.py; a test keeps this
# list equal to accelerate's)
TENSORBOARD = "tensorboard"
NO_TRACKER = "none"
ACCELERATE_TRACKERS = ("aim", "clearml", "comet_ml", "dvclive", "mlflow", "swanlab", "trackio", "wandb")
REPORT_TO = (TENSORBOARD, NO_TRACKER, *ACCELERATE_TRACKERS)


def listed(names) -> str:
    """ "a, b or c": how an error message offers the choices."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
