"""model.loss: fused (issue 20): 20-step GPT and Llama runs with the fused
linear + cross-entropy equal the plain loss run (loss and gradient norm of
every step within 1e-5), untied heads and recompute included; `auto` picks the
fused loss once a micro-batch's tokens exceed loss_chunk_size and the plain
loss below. Which loss ran is read from the run's record of its first step
(run_dir/active/rank0.json: the forwards each loss counted), not from the log
line that names the configured one.
"""
import json

import pytest

from conftest import CONFIGS, assert_active, loss_ran, run_ranks


def assert_loss(run_dir, kind):
    loss_ran({0: json.loads((run_dir / "active" / "rank0.json").read_text())}, kind)

STEPS = 20
TOL = 1e-5
# A Llama as small as tiny_gpt's GPT: GQA, untied head, 64-token vocabulary.
LLAMA = ["--model.type", "llama", "--model.args",
         "{vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
         "num_key_value_heads: 2, max_position_embeddings: 16, tie_word_embeddings: false}"]


def per_step(run):
    assert sorted(r["step"] for r in run.train) == list(range(1, STEPS + 1)), run.output
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in run.train}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("model,extra", [
    ("gpt", []),
    ("llama untied, recompute", LLAMA + ["--model.activation_checkpointing", "true"]),
])
def test_fused_loss_run_equals_plain(nnstrain, tiny_tokens, tmp_path, model, extra):
    common = ["--vars.data", tiny_tokens, "--max_train_steps", STEPS, "--val_every_n_train_steps", 0, *extra]
    plain = nnstrain("tiny_gpt.yaml", *common, "--model.loss", "plain", run_dir=tmp_path / "plain")
    # 4 x 16 tokens per step in chunks of 24: 24, 24, 16.
    fused = nnstrain("tiny_gpt.yaml", *common, "--model.loss", "fused", "--model.loss_chunk_size", 24,
                     run_dir=tmp_path / "fused")
    assert "LM head loss: fused (chunks of 24 tokens)" in fused.output, fused.output
    assert_loss(tmp_path / "plain", "plain")
    assert_active(tmp_path / "fused", fused.output, 1, extra)  # the fused loss's forwards, recompute
    assert_loss(tmp_path / "fused", "fused")
    a, b = per_step(plain), per_step(fused)
    worst_loss = max(rel(b[s][0], a[s][0]) for s in a)
    worst_norm = max(rel(b[s][1], a[s][1]) for s in a)
    print(f"{model}: fused vs plain over {STEPS} steps: loss {worst_loss:.2e}, grad norm {worst_norm:.2e}")
    assert worst_loss < TOL and worst_norm < TOL
    assert a[STEPS][0] < a[1][0] - 0.1  # it trained: the comparison is of a moving model


def test_auto_picks_fused_above_the_chunk_and_plain_below(nnstrain, tiny_tokens, tmp_path):
    common = ["--vars.data", tiny_tokens, "--max_train_steps", 2, "--val_every_n_train_steps", 0]
    above = nnstrain("tiny_gpt.yaml", *common, "--model.loss_chunk_size", 63, run_dir=tmp_path / "above")
    below = nnstrain("tiny_gpt.yaml", *common, "--model.loss_chunk_size", 64, run_dir=tmp_path / "below")
    assert "LM head loss: fused (chunks of 63 tokens), chosen by model.loss: auto" in above.output, above.output
    assert "LM head loss: plain, chosen by model.loss: auto" in below.output, below.output
    assert_loss(tmp_path / "above", "fused")
    assert_loss(tmp_path / "below", "plain")


def test_unknown_loss_is_refused(nnstrain, tiny_tokens, tmp_path):
    p = nnstrain("tiny_gpt.yaml", "--vars.data", tiny_tokens, "--model.loss", "fast", run_dir=tmp_path / "r",
                 check=False)
    assert p.returncode == 2, p.output
    assert "model.loss" in p.output and "fused" in p.output, p.output


# Gemma 3's capped head (final_logit_softcapping 2.0: logits within +-2, so the cap shapes every step).
GEMMA = ["--model.type", "gemma3", "--model.args",
         "{vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
         "num_key_value_heads: 2, head_dim: 8, query_pre_attn_scalar: 8, max_position_embeddings: 16, "
         "sliding_window: 8, final_logit_softcapping: CAP}"]


def test_softcapped_head_every_loss_equals_plain(nnstrain, tiny_tokens, tmp_path):
    """The chunked and fused losses cap each chunk's logits and carry the cap's derivative: 20 steps
    of each equal the plain (capped composite) loss; the cap changes the run (so it is what ran)."""
    common = ["--vars.data", tiny_tokens, "--max_train_steps", STEPS, "--val_every_n_train_steps", 0,
              "--model.loss_chunk_size", 24]
    gemma = [a.replace("CAP", "2.0") for a in GEMMA]
    runs = {}
    for kind in ("plain", "chunked", "fused"):
        runs[kind] = per_step(nnstrain("tiny_gpt.yaml", *common, *gemma, "--model.loss", kind, run_dir=tmp_path / kind))
        assert_loss(tmp_path / kind, kind)
    for kind in ("chunked", "fused"):
        worst = max(max(rel(runs[kind][s][0], runs["plain"][s][0]), rel(runs[kind][s][1], runs["plain"][s][1]))
                    for s in runs["plain"])
        print(f"softcapped head: {kind} vs plain over {STEPS} steps: {worst:.2e}")
        assert worst < TOL, (kind, runs[kind], runs["plain"])
    uncapped = per_step(nnstrain("tiny_gpt.yaml", *common, *[a.replace("CAP", "0") for a in GEMMA],
                                 "--model.loss", "fused", run_dir=tmp_path / "uncapped"))
    moved = max(rel(uncapped[s][1], runs["plain"][s][1]) for s in uncapped)  # gradient norms: 3.7% at step 20
    assert moved > 1e-2, (uncapped, runs["plain"])
    # Over a vocabulary split in two (tp 2): each rank caps its piece; chunked and fused equal one process.
    for kind in ("chunked", "fused"):
        d = tmp_path / f"tp2_{kind}"
        tp = ["--compute_config.plan_ngpus", "2", "--pas_policy", "tp"]
        got = run_ranks(2, d, ["--config", str(CONFIGS / "tiny_gpt.yaml"), "--run_dir", str(d), *map(str, common),
                               *gemma, "--model.loss", kind, "--compute_config.backend", "gloo", *tp], tp)
        assert_loss(d, kind)
        worst = max(max(rel(got[s][0], runs["plain"][s][0]), rel(got[s][1], runs["plain"][s][1])) for s in got)
        print(f"softcapped head, tp 2 {kind} vs one process plain: {worst:.2e}")
        assert sorted(got) == list(range(1, STEPS + 1)) and worst < TOL, (kind, got)
