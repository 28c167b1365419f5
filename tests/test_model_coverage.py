"""A representative subset of the model coverage sweep (benchmarks/model_coverage.py; the
whole table is `make test-models`): models autohybrid did not write — Hugging Face
architectures from tiny configs, torch-native modules — train like eager (losses,
gathered gradients and parameters after every SGD step, float64) under the plan kinds
that broke them before (issue 17), one family per cell."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import model_coverage  # noqa: E402
from _limits import guard  # noqa: E402
from _pool import launch as pool_launch  # noqa: E402

CELLS = [
    ("mistral", "auto"),      # E1 fused rotary (fp32 only, see test_codegen) / mask per sample
    # E2 (Phi3's fused qkv / gate_up split by slicing and chunk): Phi3ForCausalLM at tp2
    # in tests/test_tp_semantics.py
    ("bert", "tp2"),          # E3 padding_idx under the vocabulary-parallel embedding
    # E4 (T5: labels= without a target-free forward) trains under dp2, tp2 and pp2 in
    # tests/test_targets.py
    ("mixtral", "dp2"),       # E5 per-token expert dispatch under dp
    ("gru", "tp2"),           # E7 recurrent model under tp
    ("bart", "pp2"),          # tied embeddings / shifted labels across pipeline stages
    ("transformer", "pp2"),   # nn.Transformer encoder-decoder across stages
    # a padding mask read by rows of the ids' batch (every dp plan was refused before),
    # shards and microbatches holding different numbers of real tokens
    ("llama_padded", "dp2x2"),
    ("bert_padded", "pp2x4"),
    # losses adding means over other counts (every dp and microbatched plan was refused
    # before): question answering's (start + end) / 2 over the two positions kept, GPT-2's
    # double heads 2 · lm_loss + 0.5 · mc_loss (tokens kept, samples)
    ("bert_qa", "dp2x2"),
    ("gpt2_double_heads", "pp2x4"),
    # the mask's rows picked by positions counted in the ids' (dp was refused before)
    ("bert_mc", "dp2"),
]


def _on_warm_ranks(fn, args: tuple) -> list:
    return pool_launch(fn, 2, args=args, timeout_s=guard(200))


@pytest.mark.procs
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,plan", CELLS, ids=[f"{n}-{p}" for n, p in CELLS])
def test_model_trains_like_eager(name: str, plan: str) -> None:
    results = model_coverage.sweep([name], [plan], steps=2, log=lambda line: None,
                                   launch=_on_warm_ranks)
    status, detail, _ = results[name, plan]
    assert status == "equal", f"{name} under {plan}: {status}: {detail}"
