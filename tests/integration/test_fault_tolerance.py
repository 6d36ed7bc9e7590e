"""Runs that survive faults (issue 39), on CPU with Gloo and tiny GPTs:

- `nnstrain launch --max-restarts 2`: a rank SIGKILLed at a random step of a
  4-rank dp2 x tp2 run and of a 2-rank pp 2 run (test switch NNSTRAIN_TEST_KILL_AT, first attempt only)
  is restarted from the latest checkpoint; the losses equal the uninterrupted
  run's bitwise and run_dir/restarts.jsonl records one restart with its cost;
  with two launchers (--nnodes 2, one per pipeline stage) the rank on node 1
  is killed and both launchers log the same restart, agreed through node 0's;
- a failure at the same step after a restart (NNSTRAIN_TEST_TORCH_ERROR_AT) is
  reported as deterministic and not retried again;
- a loss spike made by the data (a data step of a token that never occurs
  elsewhere, placed here with the trainer's sample formula) is rerun, found
  reproduced, rewound and its data step skipped, exactly the configured window;
  a resume after the skip is exact; a non-finite step that is gone on its
  rerun (NNSTRAIN_TEST_NONFINITE_ONCE) is a transient fault, nothing skipped;
  one made by its data step (NNSTRAIN_TEST_NONFINITE_DATA_AT) is rewound and
  skipped;
- a rank slowed at every forward (NNSTRAIN_TEST_SLOW_RANK) is named as the
  straggler; frozen for good (NNSTRAIN_TEST_STOP_AT) the other rank's flight
  recorder file makes `nnstrain report` name the collective it never joined;
  SIGUSR2 makes both ranks write their flight records while training goes on;
- a parameter changed on one replica (NNSTRAIN_TEST_CORRUPT_PARAM) is named at
  the next checksum step and the run stops; so is the tied embedding changed
  on the first of 2 pipeline stages; under ep 2 on 2 ranks (each holding other
  experts) the first check passes and the change is still found;
- a restart before the run's first save resumes from the run's own --resume
  PATH, and one without checkpoint.save_dir starts from scratch; a restart
  after a spike rewind skips what the rewind skipped and, resumed before the
  spike, still sees it (the detector's history travels in the checkpoint).

Losses are compared as the JSON numbers the trainer wrote (shortest round trip:
equality there is bitwise equality).
"""
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from conftest import CONFIGS, SOURCE, nnstrain_bin_path, read_metrics, single_process_env, splitmix64, write_token_file

DP = CONFIGS / "tiny_dp.yaml"
TINY = CONFIGS / "tiny_gpt.yaml"
MOE = CONFIGS / "tiny_moe_ep.yaml"


def launch(nproc, args, *, restarts=None, env=None, timeout=240):
    cmd = [nnstrain_bin_path(), "launch", "--nproc-per-node", str(nproc)]
    if restarts is not None:
        cmd += ["--max-restarts", str(restarts)]
    cmd += ["--", *map(str, args)]
    p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1, **(env or {})), capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def losses(run_dir):
    train, _ = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
    out = {}
    for r in train:
        if "loss" in r:
            assert r["step"] not in out, f"step {r['step']} logged twice"
            out[r["step"]] = r["loss"]
    return out


def events(run_dir):
    train, _ = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
    return [r for r in train if "fault_tolerance" in r]


# --- automatic restart -------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HYBRID = ["--model.args.n_head", "4", "--global_batch_size", "4", "--micro_batch_size", "2",
          "--compute_config.plan_ngpus", "2", "--pas_policy", "hybrid", "--max_train_steps", "6",
          "--log_progress_every_n_train_steps", "1", "--val_every_n_train_steps", "0",
          "--lr_scheduler.args.decay_steps", "6", "--checkpoint.every_n_train_steps", "2",
          "--checkpoint.async_save", "false"]  # every checkpoint before the kill is complete


# A pipeline of 2 stages on 2 ranks (4 micro-batches of 1), the same data, schedule and saves.
PP2 = ["--model.args.n_head", "4", "--global_batch_size", "4", "--micro_batch_size", "1",
       "--compute_config.pas_config.pp_size", "2", "--max_train_steps", "6",
       "--log_progress_every_n_train_steps", "1", "--val_every_n_train_steps", "0",
       "--lr_scheduler.args.decay_steps", "6", "--checkpoint.every_n_train_steps", "2",
       "--checkpoint.async_save", "false"]


def hybrid_args(tokens, d, plan=HYBRID):
    return ["--config", DP, "--vars.data", tokens, "--run_dir", d, "--checkpoint.save_dir", d / "ckpt", *plan]


_straight = {}


def straight_losses(tokens, tmp_path, ranks, plan):
    """The uninterrupted run's losses, once per plan for the module (the pp 2 plan serves two tests)."""
    key = (ranks, tuple(plan))
    if key not in _straight:
        d = tmp_path / "straight"
        rc, out = launch(ranks, hybrid_args(tokens, d, plan))
        assert rc == 0, out
        _straight[key] = losses(d)
        assert sorted(_straight[key]) == list(range(1, 7))
    return _straight[key]


def check_one_restart(d, rank, step, want):
    got = losses(d)
    assert got == want, f"restarted run's losses differ from the uninterrupted run's:\n{got}\n{want}"
    restarts = [json.loads(line) for line in (d / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1, restarts
    r = restarts[0]
    resumed = (step - 1) // 2 * 2  # the latest checkpoint before the failed step (every 2 steps)
    assert r["restart"] == 1 and f"rank {rank} was killed" in r["cause"], r
    assert r["resumed_at_step"] == resumed and r["first_step"] == resumed + 1, r
    assert r["seconds_from_failure_to_first_step"] > 0, r
    print(f"restart cost (failure to the first step after it): {r['seconds_from_failure_to_first_step']:.2f} s")


@pytest.mark.parametrize("ranks,plan", [(4, HYBRID), (2, PP2)], ids=["dp2_tp2", "pp2"])
def test_sigkilled_rank_is_restarted_and_the_run_is_exact(tiny_tokens, tmp_path, ranks, plan):
    rng = random.Random()
    step, rank = rng.randint(3, 6), rng.randint(0, ranks - 1)
    print(f"SIGKILL at step {step} on rank {rank}")
    want = straight_losses(tiny_tokens, tmp_path, ranks, plan)

    d = tmp_path / "killed"
    rc, out = launch(ranks, hybrid_args(tiny_tokens, d, plan), restarts=2,
                     env={"NNSTRAIN_TEST_KILL_AT": f"{step}:{rank}"})
    assert rc == 0, out
    assert f"restart 1 of 2: rank {rank} was killed by signal 9 (SIGKILL) at step {step}" in out, out
    assert "restart 2 of 2" not in out, out
    check_one_restart(d, rank, step, want)


def test_two_nodes_restart_together_through_the_rendezvous(tiny_tokens, tmp_path):
    """Two launchers (--nnodes 2, one pipeline stage each) on this machine; rank 1, on node 1, is
    SIGKILLed: node 0's launcher decides, both log the same restart and start attempt 1 together."""
    step = random.Random().randint(3, 6)
    print(f"SIGKILL at step {step} on rank 1 (node 1)")
    want = straight_losses(tiny_tokens, tmp_path, 2, PP2)
    d = tmp_path / "killed"
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [nnstrain_bin_path(), "launch", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "2", "--",
               *map(str, hybrid_args(tiny_tokens, d, PP2))]
        procs.append(subprocess.Popen(cmd, cwd=SOURCE, env=single_process_env(1, NNSTRAIN_TEST_KILL_AT=f"{step}:1"),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for node, (p, out) in enumerate(zip(procs, outs)):
        print(f"node {node}:", *[l for l in out.splitlines() if l.startswith("nnstrain launch:")], sep="\n  ")
        assert p.returncode == 0, f"node {node}:\n{out}"
        line = f"nnstrain launch: restart 1 of 2: rank 1 was killed by signal 9 (SIGKILL) at step {step}"
        assert line in out, f"node {node}:\n{out}"
        assert "restart 2 of 2" not in out, out
    check_one_restart(d, 1, step, want)


def two_launchers(command, *, restarts=("2", "2"), timeout=60):
    port = free_port()
    procs = [subprocess.Popen([nnstrain_bin_path(), "launch", "--nproc-per-node", "1", "--nnodes", "2",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--max-restarts", restarts[node], "--exec", "--", *command],
                              env=single_process_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in range(2)]
    try:
        return [(p.communicate(timeout=timeout)[0], p.returncode) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_two_nodes_agree_that_a_failure_is_deterministic():
    """Every worker exits 3 at once, twice (--max-restarts 2): node 0's launcher decides (the earliest failure), and
    both launchers log the same restart, then the same deterministic verdict, and exit 3."""
    (out0, rc0), (out1, rc1) = two_launchers(["sh", "-c", "exit 3"])
    verdict = [re.findall(r"nnstrain launch: (restart 1 of 2: .*|deterministic failure: .*)", o) for o in (out0, out1)]
    assert rc0 == rc1 == 3, (out0, out1)
    assert len(verdict[0]) == 2 and verdict[0] == verdict[1], (out0, out1)
    assert re.fullmatch(r"deterministic failure: rank [01] exited with status 3 before training, at the same point "
                        r"as before restart 1; not restarting again", verdict[0][1]), verdict


def test_two_nodes_with_different_max_restarts_are_refused():
    (out0, rc0), (out1, rc1) = two_launchers(["true"], restarts=("1", "2"))
    assert rc0 != 0 and rc1 != 0, (out0, out1)
    why = ("node 0: the launcher of node 1 was started with --nnodes 2 --nproc-per-node 1 --max-restarts 2, "
           "this one with --nnodes 2 --nproc-per-node 1 --max-restarts 1: every node needs the same")
    assert why in out0 and why in out1, (out0, out1)


def test_failure_at_the_same_step_again_is_deterministic(tiny_tokens, tmp_path):
    args = ["--config", TINY, "--vars.data", tiny_tokens, "--run_dir", tmp_path, "--checkpoint.save_dir",
            tmp_path / "ckpt", "--checkpoint.every_n_train_steps", "2", "--max_train_steps", "6",
            "--val_every_n_train_steps", "0"]
    rc, out = launch(1, args, restarts=3, env={"NNSTRAIN_TEST_TORCH_ERROR_AT": "3"})
    assert rc != 0, out
    assert "restart 1 of 3: rank 0 exited with status 1 at step 3" in out, out
    assert "deterministic failure: rank 0 exited with status 1 at step 3, at the same step as before restart 1" in out
    assert "restart 2 of 3" not in out, out


def plain_args(d, tokens, *more):
    return ["--config", TINY, "--vars.data", tokens, "--run_dir", d, "--max_train_steps", "8",
            "--val_every_n_train_steps", "0", "--lr_scheduler.args.decay_steps", "8",
            "--checkpoint.async_save", "false", *more]


def test_restart_before_the_first_save_resumes_from_the_runs_own_source(tiny_tokens, tmp_path):
    """A run continued from another folder's checkpoint (--resume PATH), killed before its own first save:
    the restart resumes from PATH again, not from random weights at step 0."""
    a = tmp_path / "a"
    rc, out = run_one(plain_args(a, tiny_tokens, "--checkpoint.save_dir", a / "ckpt",
                                 "--checkpoint.every_n_train_steps", "4"))
    assert rc == 0, out
    b = tmp_path / "b"
    rc, out = launch(1, plain_args(b, tiny_tokens, "--checkpoint.save_dir", b / "ckpt",
                                   "--checkpoint.every_n_train_steps", "8", "--resume", a / "ckpt" / "step-00000004"),
                     restarts=1, env={"NNSTRAIN_TEST_KILL_AT": "6"})
    assert rc == 0, out
    assert "restart 1 of 1: rank 0 was killed by signal 9 (SIGKILL) at step 6" in out, out
    r = [json.loads(line) for line in (b / "restarts.jsonl").read_text().splitlines()]
    assert len(r) == 1 and r[0]["resumed_at_step"] == 4, (r, out)
    assert losses(b) == {s: v for s, v in losses(a).items() if s > 4}, out


def test_restart_without_a_save_dir_starts_from_scratch(tiny_tokens, tmp_path):
    rc, out = launch(1, plain_args(tmp_path, tiny_tokens, "--checkpoint.save_dir", ""), restarts=1,
                     env={"NNSTRAIN_TEST_KILL_AT": "3"})
    assert rc == 0, out
    assert "restart 1: no checkpoint under checkpoint.save_dir (not set) yet: starting again from scratch" in out, out
    r = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert len(r) == 1 and r[0]["resumed_at_step"] == 0, r
    assert sorted(losses(tmp_path)) == list(range(1, 9))


# --- loss spike: rerun, rewind, skip ----------------------------------------

SEED, SEQ, BATCH, SPIKE_DATA_STEP, STEPS = 1337, 16, 4, 12, 20


def sample_start(n_tokens, step, pos):
    """data/token_bin.cpp window_start: where sample (step, pos) starts."""
    return splitmix64(splitmix64(splitmix64(SEED) ^ step) ^ pos) % (n_tokens - SEQ)


@pytest.fixture(scope="module")
def spiky_tokens(tmp_path_factory):
    """The Markov token file over ids 0..62, with data step SPIKE_DATA_STEP's samples all id 63
    (never seen elsewhere), and no other sample of the run touching them."""
    path = write_token_file(tmp_path_factory.mktemp("spiky") / "tokens.bin", n_tokens=50000, vocab=63)
    tok = np.fromfile(path, dtype="<u2")
    n = len(tok)
    bad = [sample_start(n, SPIKE_DATA_STEP, p) for p in range(BATCH)]
    for s in bad:
        tok[s:s + SEQ + 1] = 63
    for step in range(STEPS + 2):
        if step == SPIKE_DATA_STEP:
            continue
        for p in range(BATCH):
            s = sample_start(n, step, p)
            assert all(s + SEQ < b or s > b + SEQ for b in bad), f"sample ({step}, {p}) overlaps the spike window"
    tok.tofile(path)
    return path


def spike_args(tokens, d, *more):
    return ["--config", TINY, "--vars.data", tokens, "--run_dir", d, "--checkpoint.save_dir", d / "ckpt",
            "--checkpoint.every_n_train_steps", "5", "--max_train_steps", STEPS, "--val_every_n_train_steps", "0",
            "--lr_scheduler.args.decay_steps", STEPS, "--compute_config.device", "cpu",
            "--fault_tolerance.spike_factor", "2", "--fault_tolerance.spike_window", "5",
            "--fault_tolerance.on_spike", "rewind", "--fault_tolerance.skip_window", "1",
            "--fault_tolerance.rerun_check", "true", *more]


def test_loss_spike_is_rerun_rewound_and_its_data_skipped(spiky_tokens, tmp_path):
    d = tmp_path / "run"
    p = subprocess.run([nnstrain_bin_path(), *map(str, spike_args(spiky_tokens, d))], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    ev = events(d)
    kinds = [(e["step"], e["fault_tolerance"]["event"], e["fault_tolerance"]["action"]) for e in ev]
    spike_step = SPIKE_DATA_STEP + 1  # training step 13 reads data step 12
    assert kinds == [(spike_step, "spike", "rerun"), (spike_step, "rerun_check", "rewind")], (kinds, out)
    assert ev[1]["fault_tolerance"]["reproduced"] is True
    assert ev[1]["fault_tolerance"]["to_step"] == 10
    # Exactly the configured window (skip_window 1): the spike step's data step.
    assert ev[1]["fault_tolerance"]["skipped_data_steps"] == [SPIKE_DATA_STEP, SPIKE_DATA_STEP + 1]
    # The run continued to the end, every step logged once, no gradient norm near the spike's.
    got = losses(d)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    train, _ = read_metrics(d / "metrics.jsonl")
    norms = {r["step"]: r["grad_norm"] for r in train if "grad_norm" in r}
    assert max(norms[s] for s in range(11, STEPS + 1)) < ev[0]["fault_tolerance"]["grad_norm"] / 2, (norms, ev[0])
    state = json.loads((d / "ckpt" / "step-00000015" / "manifest.json").read_text())["state"]
    assert state["data_cursor"]["skipped"] == [[SPIKE_DATA_STEP, SPIKE_DATA_STEP + 1]], state["data_cursor"]

    # A resume after the skip reads what the run that skipped read.
    r = tmp_path / "resumed"
    p = subprocess.run([nnstrain_bin_path(), *map(str, spike_args(spiky_tokens, r)), "--resume",
                        d / "ckpt" / "step-00000015"], cwd=SOURCE, env=single_process_env(1), capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    resumed = losses(r)
    assert sorted(resumed) == list(range(16, STEPS + 1))
    assert all(resumed[s] == got[s] for s in resumed), (resumed, got)


@pytest.mark.parametrize("kill_at", [12, 14], ids=["before_the_spike", "after_the_skip"])
def test_a_restart_keeps_the_spike_detector_and_the_skipped_data(spiky_tokens, tmp_path, kill_at):
    """Killed at step 12 (resumed from step 10, before the spike at 13): the detector's history from the
    checkpoint sees the spike at once. Killed at step 14 (after the rewind to 10 that skipped data step 12,
    before the next save at 15): the restart from step 10 skips it too and meets no spike."""
    d = tmp_path / "run"
    rc, out = launch(1, spike_args(spiky_tokens, d, "--checkpoint.async_save", "false"), restarts=1,
                     env={"NNSTRAIN_TEST_KILL_AT": str(kill_at)})
    assert rc == 0, out
    assert f"restart 1 of 1: rank 0 was killed by signal 9 (SIGKILL) at step {kill_at}" in out, out
    r = [json.loads(line) for line in (d / "restarts.jsonl").read_text().splitlines()]
    assert len(r) == 1 and r[0]["resumed_at_step"] == 10, r
    spike_step = SPIKE_DATA_STEP + 1
    kinds = [(e["step"], e["fault_tolerance"]["event"], e["fault_tolerance"]["action"]) for e in events(d)]
    # The metrics after the checkpoint are the restarted attempt's.
    want = [(spike_step, "spike", "rerun"), (spike_step, "rerun_check", "rewind")] if kill_at == 12 else []
    assert kinds == want, (kinds, out)
    assert sorted(losses(d)) == list(range(1, STEPS + 1))
    state = json.loads((d / "ckpt" / "step-00000020" / "manifest.json").read_text())["state"]
    assert state["data_cursor"]["skipped"] == [[SPIKE_DATA_STEP, SPIKE_DATA_STEP + 1]], state["data_cursor"]
    assert len(state["fault_tolerance"]["history"]) == 5, state["fault_tolerance"]


# --- a transient fault, and a non-finite step keyed on its data ---------------

def nonfinite_args(d, tokens, *more):
    return ["--config", TINY, "--vars.data", tokens, "--run_dir", d, "--checkpoint.save_dir", d / "ckpt",
            "--checkpoint.every_n_train_steps", "4", "--checkpoint.async_save", "false", "--max_train_steps", "8",
            "--val_every_n_train_steps", "0", "--lr_scheduler.args.decay_steps", "8",
            "--fault_tolerance.nonfinite_steps", "1", "--fault_tolerance.on_spike", "rewind", *more]


def run_one(args, env=None):
    p = subprocess.run([nnstrain_bin_path(), *map(str, args)], cwd=SOURCE, env=single_process_env(1, **(env or {})),
                       capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def plain_losses(tiny_tokens, tmp_path_factory):
    """The 8 steps of nonfinite_args without any fault."""
    d = tmp_path_factory.mktemp("plain")
    rc, out = run_one(nonfinite_args(d, tiny_tokens))
    assert rc == 0, out
    return losses(d)


def test_a_fault_gone_on_the_rerun_is_transient(tiny_tokens, tmp_path, plain_losses):
    # Step 6 is non-finite the first time it runs only (NNSTRAIN_TEST_NONFINITE_ONCE): a flipped bit.
    rc, out = run_one(nonfinite_args(tmp_path, tiny_tokens, "--fault_tolerance.rerun_check", "true"),
                      {"NNSTRAIN_TEST_NONFINITE_ONCE": "6"})
    assert rc == 0, out
    ev = [e["fault_tolerance"] for e in events(tmp_path)]
    assert [(e["event"], e["action"]) for e in ev] == [("nonfinite", "rerun"), ("rerun_check", "continued")], out
    assert ev[0]["to_step"] == 4 and ev[1]["reproduced"] is False, ev
    assert "different, so a transient fault; nothing skipped" in out
    # Nothing skipped: the run equals one that never met the fault, every step once.
    state = json.loads((tmp_path / "ckpt" / "step-00000008" / "manifest.json").read_text())["state"]
    assert not state["data_cursor"].get("skipped"), state["data_cursor"]
    assert losses(tmp_path) == plain_losses


def test_a_nonfinite_step_is_rewound_and_its_data_skipped(tiny_tokens, tmp_path, plain_losses):
    # Data step 5 (read by training step 6) makes the loss non-finite whenever it is read.
    rc, out = run_one(nonfinite_args(tmp_path, tiny_tokens), {"NNSTRAIN_TEST_NONFINITE_DATA_AT": "5"})
    assert rc == 0, out
    ev = [e["fault_tolerance"] for e in events(tmp_path)]
    assert [(e["event"], e["action"]) for e in ev] == [("nonfinite", "rewind")], out
    assert ev[0]["to_step"] == 4 and ev[0]["skipped_data_steps"] == [5, 6], ev
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, 9)) and all(np.isfinite(list(got.values()))), got
    # Up to the checkpoint the run is the plain one; step 6 then reads data step 6, not 5.
    assert all(got[s] == plain_losses[s] for s in range(1, 6)), (got, plain_losses)
    assert got[6] != plain_losses[6]
    state = json.loads((tmp_path / "ckpt" / "step-00000008" / "manifest.json").read_text())["state"]
    assert state["data_cursor"]["skipped"] == [[5, 6]], state["data_cursor"]


def test_a_loss_scalers_overflow_steps_are_not_nonfinite_steps(tiny_tokens, tmp_path):
    """16-mixed from a scale at which every step's gradients overflow: the scaler skips each update and backs
    off, as it should; nonfinite_steps 2 with on_spike: stop does not stop the run."""
    rc, out = run_one(plain_args(tmp_path, tiny_tokens, "--max_train_steps", "4", "--checkpoint.save_dir", "",
                                 "--precision", "16-mixed", "--loss_scaler.init_scale", "1e30",
                                 "--fault_tolerance.nonfinite_steps", "2", "--fault_tolerance.on_spike", "stop"))
    assert rc == 0, out
    train, _ = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["skipped_steps"] for r in train if "loss" in r] == [1, 2, 3, 4], train  # the scaler's overflows
    scales = [r["loss_scale"] for r in train if "loss" in r]
    assert scales == sorted(scales, reverse=True) and scales[0] > scales[-1], scales
    assert not events(tmp_path), events(tmp_path)


def test_a_nonfinite_run_confirmed_by_its_rerun_is_skipped_whole(tiny_tokens, tmp_path):
    """Steps 5 and 6 non-finite (step 5 by its number, step 6 by its data step 5), nonfinite_steps 2: the rerun
    from step 4 reproduces them, and both data steps (4 and 5) are skipped, not skip_window's one."""
    rc, out = run_one(nonfinite_args(tmp_path, tiny_tokens, "--fault_tolerance.nonfinite_steps", "2",
                                     "--fault_tolerance.rerun_check", "true"),
                      {"NNSTRAIN_TEST_NONFINITE_AT": "5", "NNSTRAIN_TEST_NONFINITE_DATA_AT": "5"})
    assert rc == 0, out
    ev = [e["fault_tolerance"] for e in events(tmp_path)]
    assert [(e["event"], e["action"]) for e in ev] == [("nonfinite", "rerun"), ("rerun_check", "rewind")], out
    assert ev[1]["to_step"] == 4 and ev[1]["skipped_data_steps"] == [4, 6], ev
    state = json.loads((tmp_path / "ckpt" / "step-00000008" / "manifest.json").read_text())["state"]
    assert state["data_cursor"]["skipped"] == [[4, 6]], state["data_cursor"]


def test_an_async_save_of_a_step_saved_before_a_rewind(tiny_tokens, tmp_path):
    """2 ranks, asynchronous saves every 4 steps, nonfinite_steps 2: steps 8 (by its number) and 9 (by its data
    step 8) are non-finite, step 8 is saved between them, and the rewind goes back to step 4: step 8 (non-finite
    again, its update skipped) is saved a second time, which every rank agrees on as on the first."""
    args = ["--config", DP, "--vars.data", tiny_tokens, "--run_dir", tmp_path, "--micro_batch_size", "2",
            "--max_train_steps", "12", "--val_every_n_train_steps", "0", "--lr_scheduler.args.decay_steps", "12",
            "--checkpoint.save_dir", tmp_path / "ckpt", "--checkpoint.every_n_train_steps", "4",
            "--checkpoint.async_save", "true", "--compute_config.collective_timeout_s", "20",
            "--fault_tolerance.nonfinite_steps", "2", "--fault_tolerance.on_spike", "rewind"]
    rc, out = launch(2, args, env={"NNSTRAIN_TEST_NONFINITE_AT": "8", "NNSTRAIN_TEST_NONFINITE_DATA_AT": "8"},
                     timeout=120)
    assert rc == 0, out
    ev = [e["fault_tolerance"] for e in events(tmp_path)]
    assert [(e["event"], e["action"], e["to_step"]) for e in ev] == [("nonfinite", "rewind", 4)], out
    assert out.count("saved checkpoint " + str(tmp_path / "ckpt" / "step-00000008")) == 2, out  # twice (rank 0 logs it)
    state = json.loads((tmp_path / "ckpt" / "step-00000012" / "manifest.json").read_text())["state"]
    assert state["data_cursor"]["skipped"] == [[7, 9]], state["data_cursor"]


# --- straggler and flight recorder --------------------------------------------

def test_slow_rank_is_named_and_a_frozen_rank_is_found_in_the_flight_records(tiny_tokens, tmp_path):
    d = tmp_path / "run"
    args = [nnstrain_bin_path(), "--config", str(DP), "--vars.data", str(tiny_tokens), "--run_dir", str(d),
            "--micro_batch_size", "2", "--max_train_steps", "100", "--log_progress_every_n_train_steps", "1",
            "--val_every_n_train_steps", "0", "--compute_config.collective_timeout_s", "2",
            "--fault_tolerance.straggler_factor", "3", "--fault_tolerance.straggler_intervals", "3"]
    port = free_port()
    procs = []
    for rank in range(2):
        env = single_process_env(1, RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=2,
                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NNSTRAIN_TEST_SLOW_RANK="1:60",
                                 NNSTRAIN_TEST_STOP_AT="6:1")
        procs.append(subprocess.Popen(args, cwd=SOURCE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        out0, _ = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()  # frozen (SIGSTOP) for good
        procs[1].wait()
    assert procs[0].returncode != 0, out0
    train, _ = read_metrics(d / "metrics.jsonl")
    named = [r["straggler"] for r in train if "straggler" in r]
    assert named and all(s["rank"] == 1 for s in named), (named, out0)
    assert named[0]["compute_ms"] > 3 * named[0]["others_median_ms"]
    assert re.search(r"straggler: rank 1 \(\S+ cpu\)", out0), out0
    assert all(len(r["rank_compute_ms"]) == 2 for r in train if "loss" in r)

    # Rank 0 timed out in a collective and wrote its record; rank 1 never could.
    assert (d / "flight" / "rank0.json").is_file() and not (d / "flight" / "rank1.json").exists()
    rep = subprocess.run([nnstrain_bin_path(), "report", str(d), "--no-plot"], capture_output=True, text=True)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    record = json.loads((d / "flight" / "rank0.json").read_text())
    last = record["entries"][-1]
    assert last["state"].startswith("failed"), last
    want = (f"collective #{last['group_seq']}: rank 1 never joined {last['op']} '{last['what']}'")
    assert want in rep.stdout, rep.stdout
    assert "ranks with no flight record (gone or frozen before they could write): 1" in rep.stdout, rep.stdout
    assert "straggler        step" in rep.stdout and "rank step times" in rep.stdout, rep.stdout


def test_sigusr2_writes_every_rank_flight_record_and_the_run_goes_on(tiny_tokens, tmp_path):
    d = tmp_path / "run"
    steps = 40
    args = [nnstrain_bin_path(), "--config", str(DP), "--vars.data", str(tiny_tokens), "--run_dir", str(d),
            "--micro_batch_size", "2", "--max_train_steps", str(steps), "--log_progress_every_n_train_steps", "1",
            "--val_every_n_train_steps", "0"]
    port = free_port()
    procs = []
    for rank in range(2):
        # Rank 1 40 ms late at every forward: the run lasts long enough to be signalled while it trains.
        env = single_process_env(1, RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=2,
                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NNSTRAIN_TEST_SLOW_RANK="1:40")
        procs.append(subprocess.Popen(args, cwd=SOURCE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        # Training has started (the handler is installed with the process groups): signal both.
        deadline = time.monotonic() + 90
        done = 0
        while done < 3:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no step 3 within 90 s"
            time.sleep(0.05)
            if (d / "metrics.jsonl").exists():
                train, _ = read_metrics(d / "metrics.jsonl")
                done = max([r["step"] for r in train if "loss" in r], default=0)
        for p in procs:
            p.send_signal(signal.SIGUSR2)
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out
        assert rank > 0 or "flight recorder written on SIGUSR2" in out, out  # rank 0 logs
        record = json.loads((d / "flight" / f"rank{rank}.json").read_text())
        assert record["rank"] == rank and record["world_size"] == 2 and record["reason"] == "SIGUSR2", record
        assert record["entries"] and all(not e["state"].startswith("failed") for e in record["entries"]), record
    # Written while training, which went on to its last step.
    assert done < steps and sorted(losses(d)) == list(range(1, steps + 1))


# --- silent divergence --------------------------------------------------------

def test_parameter_changed_on_one_replica_is_named(tiny_tokens, tmp_path):
    args = ["--config", DP, "--vars.data", tiny_tokens, "--run_dir", tmp_path, "--micro_batch_size", "2",
            "--max_train_steps", "8", "--val_every_n_train_steps", "0",
            "--fault_tolerance.checksum_every_n_steps", "2"]
    rc, out = launch(2, args, env={"NNSTRAIN_TEST_CORRUPT_PARAM": "3:1"})
    assert rc != 0, out
    m = re.search(r"changed parameter (\S+) on rank 1 after step 3", out)
    assert m, out
    name = m.group(1)
    assert re.search(rf"step 4: parameter {re.escape(name)} differs between replicas: rank 0 checksum \d+, "
                     rf"rank 1 checksum \d+", out), out
    assert "training stops (fault_tolerance.on_checksum_mismatch: stop)" in out
    assert "step 2: parameter" not in out  # the check before the change passed


def test_tied_copy_changed_on_one_pipeline_stage_is_named(tiny_tokens, tmp_path):
    """pp 2: the GPT's embedding lives on the first stage and, tied, as the head on the last. The
    test hook changes the first stage's first parameter (the embedding) after step 3."""
    args = ["--config", DP, "--vars.data", tiny_tokens, "--run_dir", tmp_path, "--model.args.n_head", "4",
            "--global_batch_size", "4", "--micro_batch_size", "1", "--compute_config.pas_config.pp_size", "2",
            "--max_train_steps", "6", "--val_every_n_train_steps", "0", "--fault_tolerance.checksum_every_n_steps", "2"]
    rc, out = launch(2, args, env={"NNSTRAIN_TEST_CORRUPT_PARAM": "3:0"})
    assert rc != 0, out
    assert "changed parameter wte.weight on rank 0 after step 3" in out, out
    assert re.search(r"step 4: parameter wte\.weight differs between its tied copies on the first and last pipeline "
                     r"stages: rank 0 checksum \d+, rank 1 checksum \d+", out), out
    assert "step 2: parameter" not in out  # the check before the change passed


def test_expert_shards_are_compared_over_their_replicas_not_their_ep_peers(tiny_tokens, tmp_path):
    """ep 2 on 2 ranks: the dense parameters are replicas over dp 2, each rank's experts have none (its ep
    peer holds the others). The check of step 2 passes; a dense parameter changed on rank 1 is named at 4."""
    args = ["--config", MOE, "--vars.data", tiny_tokens, "--run_dir", tmp_path, "--global_batch_size", "4",
            "--micro_batch_size", "2", "--compute_config.expert_parallel_size", "2", "--max_train_steps", "6",
            "--val_every_n_train_steps", "0", "--fault_tolerance.checksum_every_n_steps", "2"]
    rc, out = launch(2, args, env={"NNSTRAIN_TEST_CORRUPT_PARAM": "3:1"})
    assert rc != 0, out
    assert "step 2: parameter" not in out, out  # the first check passed
    m = re.search(r"changed parameter (\S+) on rank 1 after step 3", out)
    assert m, out
    assert re.search(rf"step 4: parameter {re.escape(m.group(1))} differs between replicas: rank 0 checksum \d+, "
                     rf"rank 1 checksum \d+", out), out


# --- the configuration ----------------------------------------------------------

@pytest.mark.parametrize("overrides, named", [
    (["--fault_tolerance.spike_factor", "0.5"], "fault_tolerance.spike_factor"),
    (["--fault_tolerance.spike_factor", "3", "--fault_tolerance.on_spike", "rewind"], "fault_tolerance.on_spike"),
    (["--fault_tolerance.rerun_check", "true"], "fault_tolerance.rerun_check"),
    (["--fault_tolerance.spike_windw", "5"], "fault_tolerance.spike_windw"),
])
def test_wrong_fault_tolerance_keys_are_refused_naming_them(tiny_tokens, overrides, named):
    # tiny_gpt.yaml has no checkpoint.save_dir here: a rewind has nothing to go back to.
    p = subprocess.run([nnstrain_bin_path(), "--config", str(TINY), "--vars.data", str(tiny_tokens),
                        "--checkpoint.save_dir", "", *overrides, "--print-config"], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip()
    assert named in err and "\n" not in err, err
