"""lr_scheduler.type wsd (issue 41): the lr each step trained with, as logged in
metrics.jsonl, against the schedule written out below from docs/config.md (not
nnstrain's code); the annealing branch (a stable-phase checkpoint resumed with a
new decay_steps and max_train_steps); and the keys that do not fit, refused with
status 2 naming them.

The tiny GPT (tests/integration/configs/tiny_gpt.yaml), one process, a handful
of steps. Three runs share a module fixture:
- main: 6 steps, warmup 2, decay over the last 2; its checkpoint at step 4 is in
  the stable phase;
- branch: main's step-4 checkpoint resumed with max_train_steps 7, decay_steps 3;
- straight: the 7-step schedule of the branch trained from step 0, uninterrupted.
"""
import math

import pytest

CONFIG = "tiny_gpt.yaml"
LR, MIN_LR, WARMUP, SHAPE = 3.0e-3, 3.0e-4, 2, "1-sqrt"


def wsd_lr(step, total, decay):
    """The lr of 1-based `step` in a `total`-step run: warmup lr*step/(W+1), the
    base lr, then over the last `decay` steps the i-th at progress i/(decay+1),
    min_lr + (lr - min_lr)(1 - sqrt(progress))."""
    if step <= WARMUP:
        return LR * step / (WARMUP + 1)
    i = step - (total - decay)
    if i < 1:
        return LR
    return MIN_LR + (LR - MIN_LR) * (1 - math.sqrt(i / (decay + 1)))


def wsd_args(tokens, ckpt, total, decay):
    return ("--vars.data", tokens, "--checkpoint.save_dir", ckpt, "--val_every_n_train_steps", 0,
            "--max_train_steps", total, "--lr_scheduler.type", "wsd", "--lr_scheduler.args.warmup_steps", WARMUP,
            "--lr_scheduler.args.decay_steps", decay, "--lr_scheduler.args.decay_type", SHAPE,
            "--lr_scheduler.args.min_lr", MIN_LR, "--optimizer.args.lr", LR)


@pytest.fixture(scope="module")
def runs(nnstrain, tiny_tokens, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wsd")
    main = nnstrain(CONFIG, *wsd_args(tiny_tokens, tmp / "main_ckpt", 6, 2), "--checkpoint.every_n_train_steps", 4,
                    run_dir=tmp / "main")
    stable = tmp / "main_ckpt" / "step-00000004"
    branch = nnstrain(CONFIG, *wsd_args(tiny_tokens, tmp / "branch_ckpt", 7, 3), run_dir=tmp / "branch",
                      resume=stable)
    straight = nnstrain(CONFIG, *wsd_args(tiny_tokens, tmp / "straight_ckpt", 7, 3), run_dir=tmp / "straight")
    return {"main": main, "branch": branch, "straight": straight, "stable": stable, "tmp": tmp}


def assert_one_error_line(p, named):
    """The run stopped before training with one error line naming `named`, the
    last on stderr (start-up's log lines may precede it), and no backtrace."""
    lines = p.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("nnstrain: config error: ") and named in lines[-1], p.stderr
    assert sum("error" in line for line in lines) == 1, p.stderr
    assert not p.train


def lrs(run):
    return {r["step"]: r["lr"] for r in run.train}


def test_the_logged_lr_follows_the_schedule(runs):
    got = lrs(runs["main"])
    assert sorted(got) == list(range(1, 7)), got
    for step, lr in got.items():
        assert lr == pytest.approx(wsd_lr(step, 6, 2), rel=1e-12), (step, got)
    # warmup, stable, decay as named: two rising, two at the base lr, two falling, above min_lr.
    assert got[1] < got[2] < got[3] == got[4] == LR > got[5] > got[6] > MIN_LR, got
    assert "lr_scheduler wsd: warmup 2, stable at 0.003, 1-sqrt decay from step 5 to 6" in runs["main"].output


def test_the_annealing_branch_decays_from_the_resumed_step(runs):
    branch = runs["branch"]
    assert f"resumed from {runs['stable']} at step 4" in branch.output, branch.output
    got = lrs(branch)
    assert sorted(got) == [5, 6, 7], got  # a fresh run_dir: the resumed steps only
    for step, lr in got.items():
        assert lr == pytest.approx(wsd_lr(step, 7, 3), rel=1e-12), (step, got)
    # Not the main run's decay: the branch's first step is its own schedule's.
    assert got[5] != pytest.approx(wsd_lr(5, 6, 2), rel=1e-6)
    assert "jumps" not in branch.output, branch.output  # the lr continues from the checkpoint's


def test_the_branch_continues_the_checkpoint_weights(runs):
    # The 7-step schedule trained from step 0 has main's lrs for steps 1-4, so the
    # branch resumed from main's step 4 must reproduce it from there (bitwise on
    # one CPU thread, as tests/integration/test_train_resume.py shows for resume).
    branch, straight = runs["branch"].losses(), runs["straight"].losses()
    main = runs["main"].losses()
    assert [main[s] for s in (1, 2, 3, 4)] == [straight[s] for s in (1, 2, 3, 4)]
    for s in (5, 6, 7):
        assert branch[s] == straight[s], (s, branch, straight)
    assert lrs(runs["branch"]) == {s: lrs(runs["straight"])[s] for s in (5, 6, 7)}


def test_a_decay_that_began_before_the_checkpoint_is_refused(runs, nnstrain, tiny_tokens):
    # decay_steps 5 of 7 starts at step 3, before the resumed step 5: the lr would
    # jump from the stable 3e-3 down into the middle of the decay.
    tmp = runs["tmp"]
    p = nnstrain(CONFIG, *wsd_args(tiny_tokens, tmp / "bad_ckpt", 7, 5), run_dir=tmp / "bad", resume=runs["stable"],
                 check=False)
    assert p.returncode == 2, p.output
    assert_one_error_line(p, "lr_scheduler.args.decay_steps: the decay would start at step 3, before the resumed step 5")


@pytest.mark.parametrize("overrides,named", [
    (("--lr_scheduler.args.decay_steps", 7), "lr_scheduler.args.decay_steps"),  # warmup 2 + 7 > 8
    (("--lr_scheduler.args.decay_ratio", 0.5), "lr_scheduler.args.decay_ratio"),  # with decay_steps
    (("--lr_scheduler.args.decay_steps", "~", "--lr_scheduler.args.decay_ratio", 1.5), "lr_scheduler.args.decay_ratio"),
    (("--lr_scheduler.args.decay_steps", "~", "--lr_scheduler.args.decay_ratio", 0), "lr_scheduler.args.decay_ratio"),
    (("--lr_scheduler.args.decay_steps", "~", "--lr_scheduler.args.decay_ratio", 0.01), "lr_scheduler.args.decay_ratio"),
    (("--lr_scheduler.args.decay_steps", "~"), "lr_scheduler.args.decay_steps"),
    (("--lr_scheduler.args.decay_type", "sqrt"), "lr_scheduler.args.decay_type"),
    (("--lr_scheduler.type", "cosine", "--lr_scheduler.args.decay_steps", 8), "lr_scheduler.args.decay_type"),
    (("--lr_scheduler.type", "linear", "--lr_scheduler.args.decay_type", "~",
      "--lr_scheduler.args.decay_ratio", 0.5), "lr_scheduler.args.decay_ratio"),
    # A constant rate never decays: its decay length and floor would do nothing.
    (("--lr_scheduler.type", "constant", "--lr_scheduler.args.decay_type", "~"), "lr_scheduler.args.decay_steps"),
    (("--lr_scheduler.type", "constant", "--lr_scheduler.args.decay_type", "~", "--lr_scheduler.args.decay_steps", "~",
      "--lr_scheduler.args.min_lr", 1e-4), "lr_scheduler.args.min_lr"),
    # max_epochs: the run's length is known once the data is; refused at start-up.
    (("--max_train_steps", 0, "--max_epochs", 1, "--micro_batch_size", 400), "lr_scheduler.args.decay_steps"),
], ids=["decay-too-long", "steps-and-ratio", "ratio-above-one", "ratio-zero", "ratio-rounds-to-nothing",
        "no-decay-given", "unknown-shape", "decay_type-on-cosine", "decay_ratio-on-linear", "decay_steps-on-constant",
        "min_lr-on-constant", "epochs-too-short"])
def test_keys_that_do_not_fit_are_refused(nnstrain, tiny_tokens, tmp_path, overrides, named):
    base = ("--vars.data", tiny_tokens, "--max_train_steps", 8, "--lr_scheduler.type", "wsd",
            "--lr_scheduler.args.warmup_steps", 2, "--lr_scheduler.args.decay_steps", 2,
            "--lr_scheduler.args.decay_type", "cosine")
    p = nnstrain(CONFIG, *base, *overrides, run_dir=tmp_path, check=False)
    assert p.returncode == 2, p.output
    assert_one_error_line(p, named)
