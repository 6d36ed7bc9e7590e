"""Tensor and hybrid parallelism (issue 5): parity with one process, and
checkpoints that move between tensor-parallel, data-parallel and hybrid plans.

The GPT of configs/tiny_dp.yaml with 4 heads (so tp=4 splits heads, MLP and the
64-token vocabulary evenly), global batch 4 everywhere, dropout 0, clipping on.
"""
import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import (CONFIGS, SOURCE, active_records, assert_active, device_args, loss_ran, nnstrain_bin_path,
                      read_metrics, run_ranks, single_process_env, write_token_file)

CONFIG = CONFIGS / "tiny_dp.yaml"
TOL = 1e-5


def run(ranks, run_dir, data, *overrides, resume=None, save_dir=None):
    """nnstrain on `ranks` processes (through `nnstrain launch` when > 1); returns {step: (loss, grad_norm)}."""
    args = ["--config", str(CONFIG), "--run_dir", str(run_dir), "--vars.data", str(data),
            "--model.args.n_head", "4", "--global_batch_size", "4", *device_args(ranks), *map(str, overrides)]
    if save_dir:
        args += ["--checkpoint.save_dir", str(save_dir), "--checkpoint.every_n_train_steps", "5"]
    if resume:
        args += ["--resume", str(resume)]
    return run_ranks(ranks, run_dir, args, overrides)


PLANS = {  # name: (ranks, overrides)
    "tp1": (1, ["--micro_batch_size", "4"]),
    "tp2": (2, ["--micro_batch_size", "4", "--compute_config.plan_ngpus", "2", "--pas_policy", "tp"]),
    "tp4": (4, ["--micro_batch_size", "4", "--compute_config.plan_ngpus", "4", "--pas_policy", "tp"]),
    "dp2": (2, ["--micro_batch_size", "2", "--pas_policy", "dp"]),
    "hybrid_zero": (4, ["--micro_batch_size", "2", "--compute_config.plan_ngpus", "2", "--pas_policy", "hybrid",
                        "--compute_config.use_zero", "true"]),
}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def activation_mb(run_dir):
    """{step: MiB} the forward kept for backward (measured at the allocator)."""
    train, _ = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
    return {r["step"]: r["activation_mb"] for r in train}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_tokens):
    """10 uninterrupted steps under each plan, checkpoints at steps 5 and 10."""
    out = {}
    for name, (ranks, ov) in PLANS.items():
        d = tmp_path_factory.mktemp(name)
        out[name] = (run(ranks, d / "run", tiny_tokens, *ov, save_dir=d / "ckpt"), d / "ckpt")
    return out


@pytest.mark.parametrize("plan", ["tp2", "tp4", "hybrid_zero"])
def test_parity_with_one_process(straight, plan):
    ref, _ = straight["tp1"]
    got, _ = straight[plan]
    assert sorted(got) == list(range(1, 11))
    worst_loss = max(rel(got[s][0], ref[s][0]) for s in ref)
    worst_norm = max(rel(got[s][1], ref[s][1]) for s in ref)
    print(f"{plan}: largest relative loss difference {worst_loss:.2e}, grad norm {worst_norm:.2e}")
    assert worst_loss < TOL and worst_norm < TOL
    # Clipping (0.95) was active at some step, so the norm decides the update.
    assert any(ref[s][1] > 0.95 for s in ref)


@pytest.mark.parametrize("src,dst", [("tp2", "tp1"), ("tp2", "dp2"), ("tp2", "hybrid_zero"),
                                     ("tp1", "tp2"), ("dp2", "tp2"), ("hybrid_zero", "tp2")])
def test_resume_under_another_plan(straight, tmp_path, tiny_tokens, src, dst):
    """A checkpoint of step 5 under `src` resumes under `dst` with no manual step."""
    ref, _ = straight["tp1"]
    _, ckpt = straight[src]
    ranks, ov = PLANS[dst]
    got = run(ranks, tmp_path / "run", tiny_tokens, *ov, resume=ckpt / "step-00000005")
    assert sorted(got) == list(range(6, 11))
    worst = max(rel(got[s][0], ref[s][0]) for s in got)
    print(f"{src} -> {dst}: largest relative loss difference after resume {worst:.2e}")
    assert worst < TOL


def test_merge_of_tp_checkpoint_equals_single_process(straight, tmp_path):
    merged = {}
    for plan in ("tp1", "tp2", "tp4"):
        out = tmp_path / plan
        p = subprocess.run([nnstrain_bin_path(), "merge", str(straight[plan][1] / "step-00000010"), "--out", str(out)],
                           capture_output=True, text=True, env=single_process_env(1))
        assert p.returncode == 0, p.stdout + p.stderr
        merged[plan] = load_file(str(out / "model.safetensors"))
    ref = merged["tp1"]
    for plan in ("tp2", "tp4"):
        assert sorted(merged[plan]) == sorted(ref)
        worst = 0.0
        for name, t in ref.items():
            got = merged[plan][name]
            assert got.shape == t.shape, name
            if name.endswith("attn.c_attn.bias"):
                # The key bias shifts every score of a query row equally, so softmax
                # ignores it: its true gradient is 0 and Adam turns rounding noise
                # into lr-sized steps. Compare the query and value thirds only.
                third = t.shape[0] // 3
                keep = np.r_[0:third, 2 * third:3 * third]
                got, t = got[keep], t[keep]
            err = np.abs(got - t).max() / max(np.abs(t).max(), 1e-12)
            worst = max(worst, err)
            # Losses agree to 1e-7; after 10 Adam steps, elements whose gradient is
            # near zero carry the rounding of another summation order (up to ~2e-4
            # of the tensor's scale seen here), so weights are compared at 1e-3.
            assert err < 1e-3, f"{plan} {name}: relative difference {err:.2e}"
        print(f"merge of {plan} checkpoint vs one process: largest relative weight difference {worst:.2e}")


@pytest.mark.parametrize("plan", ["tp2", "tp4"])
def test_chunked_loss_parity_with_one_process(straight, tmp_path, tiny_tokens, plan):
    """model.loss: chunked under tensor parallelism is the chunked vocab-parallel
    cross-entropy (chunks of 48 of the 128 tokens per step), equal to one process."""
    chunked = ["--model.loss", "chunked", "--model.loss_chunk_size", "48"]
    ref = run(1, tmp_path / "tp1", tiny_tokens, *PLANS["tp1"][1], *chunked)
    ranks, ov = PLANS[plan]
    got = run(ranks, tmp_path / plan, tiny_tokens, *ov, *chunked)
    assert loss_ran(active_records(tmp_path / plan, ranks), "chunked") == ranks
    loss_ran(active_records(tmp_path / "tp1", 1), "chunked")
    assert sorted(got) == list(range(1, 11))
    worst_loss = max(rel(got[s][0], ref[s][0]) for s in ref)
    worst_norm = max(rel(got[s][1], ref[s][1]) for s in ref)
    print(f"{plan} chunked loss: largest relative loss difference {worst_loss:.2e}, grad norm {worst_norm:.2e}")
    assert worst_loss < TOL and worst_norm < TOL
    assert any(ref[s][1] > 0.95 for s in ref)  # clipping was active
    # The chunked loss is the plain one (to fp32 rounding), so this compares a real loss.
    plain, plain_ckpt = straight["tp1"]
    assert max(rel(ref[s][0], plain[s][0]) for s in ref) < 1e-4
    # ... and it was the chunked one: it keeps no whole logits for backward.
    chunked_act, plain_act = activation_mb(tmp_path / "tp1"), activation_mb(plain_ckpt.parent / "run")
    assert all(chunked_act[s] < plain_act[s] for s in chunked_act), (chunked_act, plain_act)


@pytest.mark.parametrize("plan,sp", [("tp2", "true"), ("tp2", "false"), ("tp4", "true")])
def test_fused_loss_parity_with_one_process(tmp_path, tiny_tokens, plan, sp):
    """model.loss: fused under tensor parallelism (with and without sequence
    parallelism) is the fused vocab-parallel cross-entropy (chunks of 48 of the
    128 tokens per step), equal to the plain loss in one process."""
    fused = ["--model.loss", "fused", "--model.loss_chunk_size", "48"]
    plain = run(1, tmp_path / "tp1", tiny_tokens, *PLANS["tp1"][1], "--model.loss", "plain")
    ranks, ov = PLANS[plan]
    got = run(ranks, tmp_path / plan, tiny_tokens, *ov, "--compute_config.sequence_parallel", sp, *fused)
    # Every tp rank ran the fused vocab-parallel loss's forward, once per micro-batch (its record).
    assert loss_ran(active_records(tmp_path / plan, ranks), "fused") == ranks
    loss_ran(active_records(tmp_path / "tp1", 1), "plain")
    assert sorted(got) == list(range(1, 11))
    worst_loss = max(rel(got[s][0], plain[s][0]) for s in plain)
    worst_norm = max(rel(got[s][1], plain[s][1]) for s in plain)
    print(f"{plan} SP {sp} fused loss vs one process plain: loss {worst_loss:.2e}, grad norm {worst_norm:.2e}")
    assert worst_loss < TOL and worst_norm < TOL


# A vocabulary tp does not divide (65): padded to 66 (tp 2) or 68 (tp 4), the
# padding rows never allocated; the token file uses all 65 ids.
ODD = ["--model.args.vocab_size", "65"]


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
    data = write_token_file(tmp_path_factory.mktemp("data65") / "tokens.bin", vocab=65)
    out = {}
    for name in ("tp1", "tp2", "tp4"):
        ranks, ov = PLANS[name]
        d = tmp_path_factory.mktemp(name + "_v65")
        out[name] = (run(ranks, d / "run", data, *ov, *ODD, save_dir=d / "ckpt"), d / "ckpt")
    return data, out


@pytest.mark.parametrize("plan", ["tp2", "tp4"])
def test_padded_vocabulary_parity_with_one_process(odd_vocab, plan):
    _, runs = odd_vocab
    ref, _ = runs["tp1"]
    got, _ = runs[plan]
    assert sorted(got) == list(range(1, 11))
    worst_loss = max(rel(got[s][0], ref[s][0]) for s in ref)
    worst_norm = max(rel(got[s][1], ref[s][1]) for s in ref)
    print(f"{plan} vocab 65: largest relative loss difference {worst_loss:.2e}, grad norm {worst_norm:.2e}")
    assert worst_loss < TOL and worst_norm < TOL
    assert any(ref[s][1] > 0.95 for s in ref)  # clipping was active


def test_padded_vocabulary_checkpoint_holds_the_true_vocabulary_and_resumes_across_tp(odd_vocab, tmp_path):
    data, runs = odd_vocab
    ref, _ = runs["tp1"]
    _, ckpt = runs["tp2"]
    # The checkpoint holds the true vocabulary: 33 + 32 rows, no padding row.
    manifest = json.loads((ckpt / "step-00000005" / "manifest.json").read_text())
    wte = [e for entries in manifest["files"].values() for e in entries if e["name"] == "model/wte.weight"]
    assert sorted((e["offsets"][0], e["shape"][0]) for e in wte) == [(0, 33), (33, 32)]
    assert all(e["global_shape"] == [65, 32] for e in wte)
    for src, dst in (("tp2", "tp4"), ("tp4", "tp1")):
        ranks, ov = PLANS[dst]
        got = run(ranks, tmp_path / f"{src}_{dst}", data, *ov, *ODD, resume=runs[src][1] / "step-00000005")
        assert sorted(got) == list(range(6, 11))
        worst = max(rel(got[s][0], ref[s][0]) for s in got)
        print(f"vocab 65 {src} -> {dst}: largest relative loss difference after resume {worst:.2e}")
        assert worst < TOL
    merged = tmp_path / "merged"
    p = subprocess.run([nnstrain_bin_path(), "merge", str(ckpt / "step-00000010"), "--out", str(merged), "--hf"],
                       capture_output=True, text=True, env=single_process_env(1))
    assert p.returncode == 0, p.stdout + p.stderr
    assert load_file(str(merged / "model.safetensors"))["transformer.wte.weight"].shape == (65, 32)


def test_shakespeare_char_config_runs_at_tp2_and_tp4_as_one_process(tmp_path):
    """configs/shakespeare_char.yaml (65 characters, 6 heads) as shipped, at tp 2 and
    tp 4 vs one process (a small batch and dropout 0 so the runs compare). At tp 4
    the 6 heads split unevenly (2, 2, 1, 1) and the vocabulary is padded; a tp 4
    checkpoint resumes at tp 2 and merges into the one-process weights."""
    data_dir = tmp_path / "data"
    for split, seed in (("train", 0), ("val", 1)):
        write_token_file(data_dir / f"{split}.bin", n_tokens=40000, vocab=65, seed=seed)
    common = ["--config", str(SOURCE / "configs" / "shakespeare_char.yaml"), "--vars.data_dir", str(data_dir),
              "--micro_batch_size", "2", "--max_train_steps", "4", "--val_every_n_train_steps", "0",
              "--log_progress_every_n_train_steps", "1", "--model.args.dropout", "0.0",
              "--compute_config.device", "cpu", "--checkpoint.every_n_train_steps", "2"]

    def train(tp, name, *extra):
        args = [*common, "--run_dir", str(tmp_path / name), "--checkpoint.save_dir", str(tmp_path / f"ckpt_{name}"),
                *extra]
        if tp > 1:  # nnScaler's command: the config's own pas_policy, only plan_ngpus given
            args += ["--compute_config.plan_ngpus", str(tp)]
        cmd = [nnstrain_bin_path(), *args] if tp == 1 else \
            [nnstrain_bin_path(), "launch", "--nproc-per-node", str(tp), "--", *args]
        p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"{name}:\n{p.stdout}{p.stderr}"
        assert f"plan tp {tp} x dp 1" in p.stdout + p.stderr, p.stdout + p.stderr
        assert_active(tmp_path / name, p.stdout + p.stderr, tp, args)
        metrics, _ = read_metrics(tmp_path / name / "metrics.jsonl")
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics}

    ref = train(1, "tp1")
    for tp in (2, 4):
        got = train(tp, f"tp{tp}")
        assert sorted(got) == [1, 2, 3, 4]
        worst_loss = max(rel(got[s][0], ref[s][0]) for s in ref)
        worst_norm = max(rel(got[s][1], ref[s][1]) for s in ref)
        print(f"shakespeare_char tp{tp} vs one process: largest relative loss difference {worst_loss:.2e}, "
              f"grad norm {worst_norm:.2e}")
        assert worst_loss < TOL and worst_norm < TOL
    # The tp 4 checkpoint holds each rank's heads: c_attn's query rows 0:128, 128:256, 256:320, 320:384.
    manifest = json.loads((tmp_path / "ckpt_tp4" / "step-00000002" / "manifest.json").read_text())
    c_attn = [e for entries in manifest["files"].values() for e in entries if e["name"] == "model/h.0.attn.c_attn.weight"]
    assert sorted((e["offsets"][0], e["shape"][0]) for e in c_attn) == [(0, 128), (128, 128), (256, 64), (320, 64)]
    resumed = train(2, "tp4_to_tp2", "--resume", str(tmp_path / "ckpt_tp4" / "step-00000002"))
    assert sorted(resumed) == [3, 4]
    worst = max(rel(resumed[s][0], ref[s][0]) for s in resumed)
    print(f"shakespeare_char tp4 -> tp2: largest relative loss difference after resume {worst:.2e}")
    assert worst < TOL
    merged = {}
    for name in ("tp1", "tp4"):
        out = tmp_path / f"merged_{name}"
        p = subprocess.run([nnstrain_bin_path(), "merge", str(tmp_path / f"ckpt_{name}" / "step-00000004"), "--out",
                            str(out), "--hf"], capture_output=True, text=True, env=single_process_env(1))
        assert p.returncode == 0, p.stdout + p.stderr
        merged[name] = load_file(str(out / "model.safetensors"))
    assert sorted(merged["tp4"]) == sorted(merged["tp1"])
    assert merged["tp4"]["transformer.wte.weight"].shape == (65, 384)
    for name, t in merged["tp1"].items():
        got = merged["tp4"][name]
        assert got.shape == t.shape, name
        # As in test_merge_of_tp_checkpoint_equals_single_process: weights after Adam steps at 1e-3.
        err = np.abs(got - t).max() / max(np.abs(t).max(), 1e-12)
        assert err < 1e-3, f"{name}: relative difference {err:.2e}"
    p = subprocess.run([nnstrain_bin_path(), "plan", "--config", str(SOURCE / "configs" / "shakespeare_char.yaml"),
                        "--runtime-ngpus", "8", "--compute_config.plan_ngpus", "8", "--pas_policy", "tp"],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "attention heads 6 are fewer than tp 8" in p.stdout + p.stderr


def test_dropout_at_tp2_resumes_exactly(tmp_path, tiny_tokens):
    """With dropout, every generator a tp=2 rank draws from (the default ones and
    the sharded-region one of its attention heads) is in the checkpoint: a resume
    continues the very same masks."""
    ranks, ov = PLANS["tp2"]
    drop = ["--model.args.dropout", "0.2"]
    straight = run(ranks, tmp_path / "straight", tiny_tokens, *ov, *drop, save_dir=tmp_path / "ckpt")
    resumed = run(ranks, tmp_path / "resumed", tiny_tokens, *ov, *drop, resume=tmp_path / "ckpt" / "step-00000005")
    assert sorted(resumed) == list(range(6, 11))
    assert all(resumed[s] == straight[s] for s in resumed), (resumed, straight)
    manifest = json.loads((tmp_path / "ckpt" / "step-00000005" / "manifest.json").read_text())
    names = {e["name"] for entries in manifest["files"].values() for e in entries}
    assert {"rng/tp/rank0", "rng/tp/rank1"} <= names
    # Dropout acts: the losses differ from a run without it.
    plain = run(ranks, tmp_path / "plain", tiny_tokens, *ov)
    assert plain[10][0] != straight[10][0]


def test_without_sequence_parallelism_parity_with_one_process(straight, tmp_path, tiny_tokens):
    """The plans above run with sequence parallelism (the default at tp > 1); without it too."""
    ref, _ = straight["tp1"]
    ranks, ov = PLANS["tp2"]
    got = run(ranks, tmp_path / "run", tiny_tokens, *ov, "--compute_config.sequence_parallel", "false")
    worst_loss = max(rel(got[s][0], ref[s][0]) for s in ref)
    worst_norm = max(rel(got[s][1], ref[s][1]) for s in ref)
    print(f"tp2 without sequence parallelism: largest relative loss difference {worst_loss:.2e}, "
          f"grad norm {worst_norm:.2e}")
    assert worst_loss < TOL and worst_norm < TOL


def test_sequence_parallel_needs_a_divisible_sequence(tmp_path, tiny_tokens):
    args = ["--config", str(CONFIG), "--run_dir", str(tmp_path / "run"), "--vars.data", str(tiny_tokens),
            "--vars.seq_len", "30", "--model.args.n_head", "4", "--global_batch_size", "4",
            "--micro_batch_size", "4", "--compute_config.plan_ngpus", "4", "--pas_policy", "tp"]
    p = subprocess.run([nnstrain_bin_path(), "launch", "--nproc-per-node", "4", "--", *args], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "compute_config.sequence_parallel" in p.stdout + p.stderr and "30 tokens" in p.stdout + p.stderr
