"""Optimizer post-validation (compute_config.pas_config.pipeline_post_validation, issue 21):
a run with it is bitwise the same run as without it, also when clipping triggers
on some steps and not on others, when a step is non-finite under fp16, and across
a resume; what it cannot follow is refused.

The reference is the same run without post-validation, logging every step (its
per-step gradient norms say which steps clip); the run under test logs every 4th
step only, since logged steps stay synchronous and the others are the ones taken
speculatively. Compared bitwise: the logged records (loss, grad_norm,
skipped_steps, loss_scale) and the final checkpoint's tensor files. A 4-layer
untied Llama, 12 steps, CPU/Gloo.
"""
import json
import pathlib
import re
import subprocess

import pytest

from conftest import CONFIGS, SOURCE, device_args, nnstrain_bin_path, read_metrics, single_process_env

CONFIG = CONFIGS / "tiny_dp.yaml"
STEPS = 12
EVERY = 4  # the run under test logs (and so runs synchronously) every 4th step
SPECULATIVE = [s for s in range(1, STEPS) if s % EVERY]
CLIP = 0.93  # between the gradient norms these runs see (0.78 to 1.07): some steps clip, some do not
KEYS = ("loss", "grad_norm", "skipped_steps", "loss_scale")
LLAMA = ("{vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 4, num_attention_heads: 4, "
         "num_key_value_heads: 2, max_position_embeddings: 32, tie_word_embeddings: false}")
PV = ["--compute_config.pas_config.pipeline_post_validation", "true"]


def run(ranks, run_dir, data, *overrides, env=None, check=True):
    args = ["--config", str(CONFIG), "--run_dir", str(run_dir), "--vars.data", str(data), "--micro_batch_size", "2",
            "--global_batch_size", "8", "--max_train_steps", str(STEPS), *device_args(ranks),
            "--model.type", "llama", "--model.args", LLAMA, "--checkpoint.save_dir", str(pathlib.Path(run_dir) / "ckpt"),
            "--checkpoint.save_on_end", "true", "--checkpoint.async_save", "false", *map(str, overrides)]
    binary = nnstrain_bin_path()
    cmd = [binary, *args] if ranks == 1 else [binary, "launch", "--nproc-per-node", str(ranks), "--", *args]
    p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1, **(env or {})), capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    if check:
        assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{out}"
    return p.returncode, out


def records(run_dir):
    train, _ = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
    return {r["step"]: {k: r.get(k) for k in KEYS} for r in train}


def rolled_back(run_dir, ranks):
    """Per rank: (speculative steps, rollbacks) from its closing line; the steps it rolled back."""
    counts, steps = [], []
    for r in range(ranks):
        log = (pathlib.Path(run_dir) / "logs" / f"rank{r}.log").read_text()
        m = re.search(r"optimizer post-validation: (\d+) steps taken speculatively, (\d+) rolled back", log)
        assert m, f"rank {r} logged no post-validation summary:\n{log}"
        counts.append((int(m.group(1)), int(m.group(2))))
        steps.append([int(s) for s in re.findall(r"step (\d+): optimizer post-validation rolled back", log)])
    assert all(c == counts[0] for c in counts) and all(s == steps[0] for s in steps), (counts, steps)
    return counts[0], steps[0]


def assert_same_run(ref_dir, got_dir, step):
    """The logged records at every step the run under test logged, and the checkpoint at `step`, bitwise."""
    ref, got = records(ref_dir), records(got_dir)
    assert sorted(got) == [s for s in range(EVERY, STEPS + 1, EVERY)], got
    for s, rec in got.items():
        assert rec == ref[s], f"step {s}: {rec} vs {ref[s]}"
    a = pathlib.Path(ref_dir) / "ckpt" / f"step-{step:08d}"
    b = pathlib.Path(got_dir) / "ckpt" / f"step-{step:08d}"
    files = sorted(p.name for p in a.glob("rank-*.safetensors"))
    assert files and files == sorted(p.name for p in b.glob("rank-*.safetensors")), (files, list(b.iterdir()))
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f"checkpoint {f} differs"


PLANS = {
    "zbv_pp2": (2, ["--compute_config.pas_config.pp_size", 2, "--compute_config.pas_config.pipeline_scheduler", "zbv"]),
    "1f1b_pp2": (2, ["--compute_config.pas_config.pp_size", 2]),
    "1f1b_pp2_dp2_zero1": (4, ["--compute_config.pas_config.pp_size", 2, "--compute_config.use_zero", 1]),
    "zbv_pp2_dp2_zero2": (4, ["--compute_config.pas_config.pp_size", 2, "--compute_config.use_zero", 2,
                              "--compute_config.pas_config.pipeline_scheduler", "zbv"]),
    "zbv_pp2_tp2_sp": (4, ["--compute_config.pas_config.pp_size", 2, "--compute_config.pas_config.pipeline_scheduler",
                           "zbv", "--compute_config.plan_ngpus", 2, "--pas_policy", "hybrid",
                           "--compute_config.sequence_parallel", "true"]),
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_bitwise_the_run_without_it_with_clipping_on_some_steps(tmp_path, tiny_tokens, plan):
    ranks, ov = PLANS[plan]
    ov = [*ov, "--optimizer.clip_gnorm", CLIP]
    run(ranks, tmp_path / "ref", tiny_tokens, *ov, "--log_progress_every_n_train_steps", 1)
    run(ranks, tmp_path / "pv", tiny_tokens, *ov, *PV, "--log_progress_every_n_train_steps", EVERY)
    assert_same_run(tmp_path / "ref", tmp_path / "pv", STEPS)
    # Which speculative steps clip, from the reference's norms: both kinds occur,
    # and exactly the clipped ones were rolled back (and redone).
    ref = records(tmp_path / "ref")
    clipped = [s for s in SPECULATIVE if ref[s]["grad_norm"] + 1e-6 > CLIP]
    assert clipped and len(clipped) < len(SPECULATIVE), {s: ref[s]["grad_norm"] for s in SPECULATIVE}
    (speculated, rollbacks), steps = rolled_back(tmp_path / "pv", ranks)
    print(f"{plan}: {speculated} steps speculative, rolled back {steps} (clipped in the reference: {clipped})")
    assert speculated == len(SPECULATIVE) and steps == clipped and rollbacks == len(clipped)


def test_fp16_overflow_rolls_back_exactly(tmp_path, tiny_tokens):
    """16-mixed with a non-finite loss injected at step 3 on every rank (the last
    stage's is what counts): the step is skipped, the scale backs off, and the
    speculative step taken before that was known is undone, bitwise."""
    ov = [*PLANS["zbv_pp2"][1], "--precision", "16-mixed"]
    env = {"NNSTRAIN_TEST_NONFINITE_AT": "3"}
    run(2, tmp_path / "ref", tiny_tokens, *ov, "--log_progress_every_n_train_steps", 1, env=env)
    run(2, tmp_path / "pv", tiny_tokens, *ov, *PV, "--log_progress_every_n_train_steps", EVERY, env=env)
    ref = records(tmp_path / "ref")
    assert ref[2]["skipped_steps"] == 0 and ref[3]["skipped_steps"] == 1, ref  # the injection is what skipped
    assert ref[3]["loss_scale"] < ref[2]["loss_scale"], ref
    assert_same_run(tmp_path / "ref", tmp_path / "pv", STEPS)
    _, steps = rolled_back(tmp_path / "pv", 2)
    assert 3 in steps, steps
    log = (tmp_path / "pv" / "logs" / "rank0.log").read_text()
    assert "step 3: optimizer post-validation rolled back (the gradient norm was not finite)" in log


def test_resume_mid_run_continues_the_same_run(tmp_path, tiny_tokens):
    """Saved at step 6 (a save step is synchronous), resumed to 12 under post-validation:
    the uninterrupted run without it, bitwise."""
    ov = [*PLANS["1f1b_pp2"][1], "--optimizer.clip_gnorm", CLIP]
    run(2, tmp_path / "ref", tiny_tokens, *ov, "--log_progress_every_n_train_steps", 1)
    run(2, tmp_path / "first", tiny_tokens, *ov, *PV, "--log_progress_every_n_train_steps", EVERY,
        "--checkpoint.every_n_train_steps", 6, "--max_train_steps", 7)
    run(2, tmp_path / "pv", tiny_tokens, *ov, *PV, "--log_progress_every_n_train_steps", EVERY,
        "--resume", tmp_path / "first" / "ckpt" / "step-00000006")
    ref, got = records(tmp_path / "ref"), records(tmp_path / "pv")
    assert sorted(got) == [8, 12], got
    for s in got:
        assert got[s] == ref[s], f"step {s}: {got[s]} vs {ref[s]}"
    a, b = tmp_path / "ref" / "ckpt" / "step-00000012", tmp_path / "pv" / "ckpt" / "step-00000012"
    for f in sorted(p.name for p in a.glob("rank-*.safetensors")):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize("ranks,ov,why", [
    (1, [], "pp_size of 2 or more"),
    (2, ["--compute_config.pas_config.pp_size", 2, "--compute_config.use_zero", 3], "use_zero: 3"),
])
def test_what_it_cannot_follow_is_refused(tmp_path, tiny_tokens, ranks, ov, why):
    rc, out = run(ranks, tmp_path, tiny_tokens, *ov, *PV, check=False)
    assert rc != 0, out
    lines = [l for l in out.splitlines() if "pipeline_post_validation" in l]
    assert lines and why in lines[0], out
    assert "Traceback" not in out and "frame #" not in out, out


def test_dropout_rerun_draws_what_the_first_run_drew(tmp_path, tiny_tokens):
    """GPT with dropout (tied embedding) under 1f1b pp2, every speculative step
    clipped, so every one rolls back and its next step's prefix reruns: the
    generators are put back, so the rerun's dropout masks are the first's."""
    ov = ["--model.type", "gpt", "--model.args",
          "{vocab_size: 64, block_size: 32, n_layer: 4, n_head: 2, n_embd: 32, dropout: 0.1, bias: true}",
          "--compute_config.pas_config.pp_size", 2, "--optimizer.clip_gnorm", 0.05]
    run(2, tmp_path / "ref", tiny_tokens, *ov, "--log_progress_every_n_train_steps", 1)
    run(2, tmp_path / "pv", tiny_tokens, *ov, *PV, "--log_progress_every_n_train_steps", EVERY)
    assert_same_run(tmp_path / "ref", tmp_path / "pv", STEPS)
    (speculated, rollbacks), _ = rolled_back(tmp_path / "pv", 2)
    assert speculated == rollbacks == len(SPECULATIVE)


def test_sigterm_stops_every_rank_at_one_step(tmp_path, tiny_tokens):
    """SIGTERM to one rank while steps overlap: the request travels with the
    next validation, every rank saves at the same step (a synchronous one) and exits 0."""
    import os
    import signal
    import time
    from test_checkpoint import children, check_save_dir, rank_of
    d = tmp_path / "stopped"
    args = ["--config", str(CONFIG), "--run_dir", str(d), "--vars.data", str(tiny_tokens), "--micro_batch_size", "2",
            "--global_batch_size", "8", "--max_train_steps", "100000", *device_args(2), "--model.type", "llama",
            "--model.args", LLAMA, "--compute_config.pas_config.pp_size", "2", *PV,
            "--log_progress_every_n_train_steps", "1000", "--checkpoint.save_dir", str(d / "ckpt")]
    # The synthetic-cost mode logs each step's end on every rank: the signal lands in training.
    env = single_process_env(1, NNSTRAIN_PIPELINE_SYNTHETIC_MS="2,2,2")
    with subprocess.Popen([nnstrain_bin_path(), "launch", "--nproc-per-node", "2", "--", *args], cwd=SOURCE,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            log = d / "logs" / "rank1.log"
            deadline = time.time() + 120
            while time.time() < deadline and not (log.exists() and log.read_text().count("pipeline synthetic step") >= 3):
                time.sleep(0.1)
            workers = {rank_of(p): p for p in children(proc.pid)}
            assert sorted(workers) == [0, 1], workers
            os.kill(workers[1], signal.SIGTERM)
            text, _ = proc.communicate(timeout=120)
        except BaseException:
            proc.kill()
            raise
    assert proc.returncode == 0, text
    assert "stopped early on request" in text, text
    last = check_save_dir(d / "ckpt")
    assert 1 <= last < 100000
    manifest = json.loads((d / "ckpt" / f"step-{last:08d}" / "manifest.json").read_text())
    assert sorted(manifest["rank_states"]) == ["0", "1"] and manifest["step"] == last
    for r in (0, 1):
        rlog = (d / "logs" / f"rank{r}.log").read_text()
        assert f"saving and stopping at step {last}" in rlog, rlog[-2000:]
        m = re.search(r"optimizer post-validation: (\d+) steps taken speculatively", rlog)
        assert m and int(m.group(1)) >= 1, rlog[-2000:]  # it stopped from overlapping steps
