"""Models autohybrid's own code did not write, built from tiny configs (never downloaded).

The model coverage sweep (`benchmarks/model_coverage.py`, `make test-models`) and the
test suite's representative subset (tests/test_model_coverage.py) build their models
here: Hugging Face `transformers` architectures from tiny configs, and torch-native
modules (LSTM, GRU, `nn.Transformer`, `nn.MultiheadAttention`). Each entry gives a
`Case`: the model (float64, dropout off, so compiled and eager runs can be compared
exactly; `dtype=torch.float32` as users run them), a few global batches, and how its loss is computed — either `loss_fn` over the
model's output or, for Hugging Face models trained with `labels=`, the model's own
`.loss` (`loss_fn=None`). The `<family>_padded` entries (`PADDED`) feed a family
right-padded batches as users train on them: token ids and their attention mask, labels
-100 where the mask pads, rows of different lengths. The `TASKS` entries are task heads
(`Task`: targets given as one tuple, each to its keyword): question answering, BERT
pre-training and GPT-2's double heads, whose losses add means over other counts, and a
multiple-choice head, whose mask's rows are picked by positions counted in its ids'.

Example::

    >>> case = build("llama")
    >>> (inputs, targets) = case.batches[0]
    >>> float(case.eager_loss(case.model, inputs, targets)) > 0
    True
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 96
SEQ = 8
BATCH = 4


@dataclasses.dataclass
class Case:
    """One model as a user would bring it, with its data and loss."""

    name: str
    model: nn.Module
    batches: list[tuple[tuple[torch.Tensor, ...], Any]]
    #: None: the model returns its loss given `labels=` (Hugging Face style)
    loss_fn: Callable | None

    def eager_loss(self, model: nn.Module, inputs: tuple, targets: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(model(*inputs), targets)
        return model(*inputs, labels=targets).loss


def lm_loss(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):  # a Hugging Face ModelOutput
        logits = logits["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _tokens(seed: int, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB,
            low: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (batch, seq), generator=g)


def _lm_batches(steps: int = 3) -> list:
    out = []
    for step in range(steps):
        tokens = _tokens(100 + step)
        out.append(((tokens,), _tokens(200 + step)))
    return out


# ----------------------------------------------------------------------------- Hugging Face
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64)

#: name → (config class, model class, config overrides, "labels" | "logits")
_HF: dict[str, tuple[str, str, dict, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2), "labels"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2), "labels"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=4, pad_token_id=0),
             "labels"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=2, head_dim=8),
              "labels"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2), "labels"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0), "labels"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "labels"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(), "labels"),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                 pad_token_id=0), "labels"),
    "bert": ("BertConfig", "BertForMaskedLM",
             dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "labels"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM",
                dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2), "labels"),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                decoder_start_token_id=0, pad_token_id=0), "labels"),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  decoder_start_token_id=2), "labels"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM",
                   dict(relative_attention=True, pos_att_type=["p2c", "c2p"],
                        position_buckets=8, max_relative_positions=-1,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                   "labels"),
    "mobilebert": ("MobileBertConfig", "MobileBertForMaskedLM",
                   dict(embedding_size=16, intermediate_size=32, intra_bottleneck_size=16,
                        true_hidden_size=16, num_feedforward_networks=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                   "labels"),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False), "labels"),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_head=4, n_layer=2), "labels"),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True),
                    "labels"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=8),
              "labels"),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM",   # a global and a local-window layer
                dict(num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                     window_size=4), "labels"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM",
                   dict(num_key_value_heads=2, sliding_window=4), "labels"),
    "granite": ("GraniteConfig", "GraniteForCausalLM",   # every one of its four multipliers
                dict(num_key_value_heads=2, embedding_multiplier=2.0, logits_scaling=4.0,
                     residual_multiplier=0.5, attention_multiplier=0.3, pad_token_id=0),
                "labels"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
                "labels"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=64),
                  "labels"),
}

#: keys no tiny config of that family takes (GPT-2 style names instead of the common ones)
_NOT_COMMON = {"gpt2": ("hidden_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings", "intermediate_size"),
               "gptj": ("hidden_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings", "intermediate_size"),
               "t5": ("hidden_size", "num_hidden_layers", "num_attention_heads",
                      "intermediate_size", "max_position_embeddings"),
               "bart": ("hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size"),
               "bloom": ("num_hidden_layers", "num_attention_heads", "intermediate_size",
                         "max_position_embeddings"),
               "gpt_bigcode": ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "max_position_embeddings", "intermediate_size"),
               "gpt_neo": ("num_hidden_layers", "num_attention_heads")}


#: families without an sdpa attention in transformers (or, T5, whose relative bias is
#: computed beside it)
_EAGER_ATTENTION = ("t5", "deberta_v2", "bloom", "gpt_neo")


def have_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _hf_model(name: str, model_cls: str | None = None) -> nn.Module:
    """Family `name`'s tiny model (`model_cls`: another head of the same config)."""
    import transformers

    config_cls, default_cls, overrides, _ = _HF[name]
    model_cls = model_cls or default_cls
    kwargs = {k: v for k, v in _COMMON.items() if k not in _NOT_COMMON.get(name, ())}
    kwargs.update(overrides)
    if name in ("mixtral", "qwen2_moe"):  # grouped_mm has no fp64 on CPU
        kwargs["experts_implementation"] = "batched_mm"
    config = getattr(transformers, config_cls)(**kwargs)
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
                "attn_pdrop", "dropout", "classifier_dropout", "summary_first_dropout",
                "summary_last_dropout"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    config.use_cache = False
    config._attn_implementation = "eager" if name in _EAGER_ATTENTION else "sdpa"
    model = getattr(transformers, model_cls)(config)
    return model.train()


def _hf_case(name: str) -> Case:
    model = _hf_model(name)
    return Case(name, model, _lm_batches(), loss_fn=None)


class Padded(nn.Module):
    """A Hugging Face model fed its token ids and padding mask by position (`ah.compile`
    passes example_inputs positionally, and not every family takes the mask second)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


#: padded batches' sequence lengths per step (right padding; a batch split in two gives
#: its halves different numbers of real tokens, so a loss averaged over a shard's own
#: tokens would differ from the whole batch's)
_LENGTHS = ((SEQ, 5, 3, 7), (6, SEQ, 2, SEQ), (4, 4, SEQ, 1))


def _padded_batches(steps: int = 3) -> list:
    """(ids, mask) and labels, -100 (ignored) where the mask pads."""
    out = []
    for step in range(steps):
        tokens = _tokens(100 + step)
        positions = torch.arange(SEQ)
        mask = torch.stack([(positions < n).long() for n in _LENGTHS[step % len(_LENGTHS)]])
        labels = _tokens(200 + step).masked_fill(mask == 0, -100)
        out.append(((tokens, mask), labels))
    return out


def _padded_case(name: str) -> Case:
    return Case(f"{name}{PADDED_SUFFIX}", Padded(_hf_model(name)), _padded_batches(),
                loss_fn=None)


# ----------------------------------------------------------------------------- task heads
class Task(nn.Module):
    """A Hugging Face task head fed its inputs by position and its targets as one tuple,
    `labels=(...)` (what `ah.compile` passes as the example targets), each to its keyword;
    `combine(output)`, where given, is the training loss from the outputs (GPT-2's
    double heads return their two losses apart)."""

    def __init__(self, model: nn.Module, inputs: tuple[str, ...], targets: tuple[str, ...],
                 combine: Callable | None = None):
        super().__init__()
        self.model, self.inputs, self.targets, self.combine = model, inputs, targets, combine

    def forward(self, *args: torch.Tensor, labels: tuple | None = None) -> Any:
        kwargs = dict(zip(self.inputs, args))
        if isinstance(labels, torch.Tensor):   # one target comes as itself
            labels = (labels,)
        kwargs.update(zip(self.targets, labels or ()))
        out = self.model(**kwargs)
        return out if self.combine is None else _Loss(loss=self.combine(out))


class _Loss(dict):
    """A dict whose `.loss` is its "loss" (Case.eager_loss and capture read `.loss`)."""

    @property
    def loss(self) -> torch.Tensor:
        return self["loss"]


def _double_heads_loss(out: Any) -> torch.Tensor:
    """GPT-2 double heads trained as its documentation shows: lm_coef · lm_loss +
    mc_coef · mc_loss (two means over different counts: tokens, samples)."""
    return 2.0 * out.loss + 0.5 * out.mc_loss


def _task_batches(name: str, steps: int = 3) -> list:
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(300 + step)
        ids = _tokens(100 + step)
        if name == "bert_qa":     # positions past the sequence are clamped to it: ignored
            inputs = (ids,)
            targets = tuple(torch.randint(0, SEQ + 3, (BATCH,), generator=g) for _ in "se")
        elif name == "bert_pretraining":   # a masked token in three, next-sentence labels
            labels = _tokens(200 + step).masked_fill(
                torch.rand(BATCH, SEQ, generator=g) > 0.35, -100)
            inputs, targets = (ids,), (labels, torch.randint(0, 2, (BATCH,), generator=g))
        elif name == "bert_mc":   # two choices per sample, padded, their own lengths
            ids = torch.stack([ids, _tokens(400 + step)], dim=1)
            lengths = torch.randint(2, SEQ + 1, (BATCH, 2, 1), generator=g)
            inputs = (ids, (torch.arange(SEQ) < lengths).long())
            targets = (torch.randint(0, 2, (BATCH,), generator=g),)
        else:                     # gpt2_double_heads: two choices per sample
            ids = torch.stack([ids, _tokens(400 + step)], dim=1)
            mc_ids = torch.randint(0, SEQ, (BATCH, 2), generator=g)
            labels = ids.masked_fill(torch.rand(BATCH, 2, SEQ, generator=g) > 0.6, -100)
            inputs = (ids, mc_ids)
            targets = (labels, torch.randint(0, 2, (BATCH,), generator=g))
        out.append((inputs, targets))
    return out


#: name → (config family, model class, inputs, targets, combine): heads whose loss adds
#: means over different counts (two positions, tokens and sentences, tokens and choices),
#: and a multiple-choice head
_TASKS: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...], Callable | None]] = {
    "bert_qa": ("bert", "BertForQuestionAnswering", ("input_ids",),
                ("start_positions", "end_positions"), None),
    "bert_pretraining": ("bert", "BertForPreTraining", ("input_ids",),
                         ("labels", "next_sentence_label"), None),
    "gpt2_double_heads": ("gpt2", "GPT2DoubleHeadsModel", ("input_ids", "mc_token_ids"),
                          ("labels", "mc_labels"), _double_heads_loss),
    # ids and mask (batch, choices, seq) flattened to batch·choices rows: its mask's rows
    # are picked by positions counted in the ids' (proven for equal choices, checked)
    "bert_mc": ("bert", "BertForMultipleChoice", ("input_ids", "attention_mask"),
                ("labels",), None),
}


def _task_case(name: str) -> Case:
    family, model_cls, inputs, targets, combine = _TASKS[name]
    return Case(name, Task(_hf_model(family, model_cls), inputs, targets, combine),
                _task_batches(name), loss_fn=None)


# ----------------------------------------------------------------------------- torch-native
class RNNLM(nn.Module):
    """Token embedding → LSTM/GRU → vocabulary projection (a classic language model)."""

    def __init__(self, kind: str, vocab: int = VOCAB, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = getattr(nn, kind)(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


class TransformerLM(nn.Module):
    """`nn.TransformerEncoder` (torch's own layers) as a causal language model."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(64, hidden) * 0.02)
        layer = nn.TransformerEncoderLayer(hidden, heads, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:seq]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, dtype=x.dtype,
                                                              device=x.device)
        return self.head(self.encoder(x, mask=mask, is_causal=True))


class Seq2SeqTransformer(nn.Module):
    """`nn.Transformer` (encoder-decoder) over token ids: source and shifted target."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.core = nn.Transformer(hidden, heads, num_encoder_layers=2, num_decoder_layers=2,
                                   dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, source: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        seq = target_in.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, dtype=self.head.weight.dtype)
        out = self.core(self.embed(source), self.embed(target_in), tgt_mask=mask,
                        tgt_is_causal=True)
        return self.head(out)


class MHABlock(nn.Module):
    """Pre-norm blocks around `nn.MultiheadAttention`, with an MLP."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class MHAModel(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(MHABlock(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _native_case(name: str) -> Case:
    torch.manual_seed(0)
    if name in ("lstm", "gru"):
        model = RNNLM(name.upper())
    elif name == "transformer_lm":
        model = TransformerLM()
    elif name == "mha":
        model = MHAModel()
    else:  # "transformer" (encoder-decoder)
        model = Seq2SeqTransformer()
        batches = []
        for step in range(3):
            source, target = _tokens(100 + step), _tokens(200 + step)
            target_in = torch.cat([torch.zeros_like(target[:, :1]), target[:, :-1]], dim=1)
            batches.append(((source, target_in), target))
        return Case(name, model, batches, lm_loss)
    return Case(name, model, _lm_batches(), lm_loss)


NATIVE = ("lstm", "gru", "transformer_lm", "transformer", "mha")
HF = tuple(_HF)
#: "<family>_padded": the family fed right-padded batches with their attention mask
PADDED_SUFFIX = "_padded"
PADDED = tuple(f"{name}{PADDED_SUFFIX}" for name in
               ("llama", "mistral", "gemma", "qwen2", "gpt2", "opt", "bert", "t5", "bart",
                "falcon", "gpt_neox"))
TASKS = tuple(_TASKS)
ALL = HF + NATIVE + PADDED + TASKS


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Case:
    """The named model (seeded, in `dtype`), its batches and its loss."""
    torch.manual_seed(seed)
    if name in _HF:
        case = _hf_case(name)
    elif name in PADDED:
        case = _padded_case(name.removesuffix(PADDED_SUFFIX))
    elif name in NATIVE:
        case = _native_case(name)
    elif name in TASKS:
        case = _task_case(name)
    else:
        raise KeyError(f"unknown coverage model {name!r}; known: {', '.join(ALL)}")
    case.model.to(dtype)
    return case
