"""A Llama at a 4096-token context through the nnstrain binary (CPU, 2 threads).

A tiny llama (2 layers, hidden 32, 2 heads, max_position_embeddings 4096) trains
2 steps of micro-batch 1 x 4096 tokens read from a uint32 token file, with the
chunked loss (chunks of 1000 tokens, so the last one is short) and activation
checkpointing: the run finishes with finite losses, and the plain loss on the
same run gives the same first loss (1e-5 relative), the same first gradient norm and,
after one optimizer step on the two losses' gradients, the same second loss
(both 1e-4 relative).
"""
import math

import numpy as np
import pytest

SEQ_LEN = 4096
VOCAB = 256
N_TOKENS = 24000  # > 20k; room for several 4097-token windows

CONFIG = """\
run_dir: {run_dir}
pas_policy: dp
compute_config: {{device: cpu}}
model:
  type: llama
  args:
    vocab_size: {vocab}
    hidden_size: 32
    intermediate_size: 64
    num_hidden_layers: 2
    num_attention_heads: 2
    num_key_value_heads: 2
    max_position_embeddings: {seq_len}
    rope_theta: 500000.0
    rms_norm_eps: 1.0e-5
    tie_word_embeddings: false
  activation_checkpointing: true
  loss: {loss}
  loss_chunk_size: 1000
optimizer:
  type: adamw
  args: {{lr: 1.0e-3, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1}}
  clip_gnorm: 1.0
dataset:
  type: token_bin
  train_args: {{path: {tokens}, dtype: uint32, seq_len: {seq_len}}}
micro_batch_size: 1
max_train_steps: 2
val_every_n_train_steps: 0
log_progress_every_n_train_steps: 1
seed: 1337
checkpoint: {{save_dir: {run_dir}/ckpt, every_n_train_steps: 0, keep_last_n_checkpoints: 0}}
"""


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A uint32 token file: a noisy cycle over the vocabulary, so the loss is not flat."""
    rng = np.random.default_rng(4096)
    t = (np.arange(N_TOKENS) * 7 + rng.integers(0, 3, size=N_TOKENS)) % VOCAB
    path = tmp_path_factory.mktemp("data") / "tokens_u32.bin"
    t.astype("<u4").tofile(path)
    return path


def train(nnstrain, tmp_path, tokens, loss):
    run_dir = tmp_path / f"run_{loss}"
    run_dir.mkdir()
    config = tmp_path / f"llama_{loss}.yaml"
    config.write_text(CONFIG.format(run_dir=run_dir, vocab=VOCAB, seq_len=SEQ_LEN, loss=loss, tokens=tokens))
    run = nnstrain(config, run_dir=run_dir, threads=2, timeout=120)
    losses = run.losses()
    assert sorted(losses) == [1, 2], f"expected steps 1 and 2 in metrics.jsonl, got {sorted(losses)}\n{run.output}"
    assert all(math.isfinite(v) for v in losses.values()), f"non-finite loss: {losses}"
    # The planner's start-up line says whether activation checkpointing is on.
    assert "recompute 2 layers" in run.output, run.output
    grad_norms = {r["step"]: r["grad_norm"] for r in run.train}
    return losses, grad_norms, {r["step"]: r["activation_mb"] for r in run.train}


def test_long_context_chunked_loss_with_activation_checkpointing(nnstrain, tmp_path, tokens):
    chunked, chunked_gn, chunked_act = train(nnstrain, tmp_path, tokens, "chunked")
    plain, plain_gn, plain_act = train(nnstrain, tmp_path, tokens, "plain")
    # The comparison is between two different losses: the chunked one never holds
    # the 4096 x 256 fp32 logits (4 MiB) for backward, the plain one does.
    assert all(chunked_act[s] < plain_act[s] - 2.0 for s in chunked_act), (chunked_act, plain_act)
    # A freshly initialised model starts near log(vocab).
    assert abs(chunked[1] - math.log(VOCAB)) < 1.0, chunked
    assert chunked[1] == pytest.approx(plain[1], rel=1e-5), (chunked, plain)
    assert chunked_gn[1] == pytest.approx(plain_gn[1], rel=1e-4), (chunked_gn, plain_gn)
    assert chunked[2] == pytest.approx(plain[2], rel=1e-4), (chunked, plain)
