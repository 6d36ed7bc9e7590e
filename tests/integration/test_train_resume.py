"""Exact resume: a run stopped at step 20 and resumed continues bit for bit as the
run that never stopped, with and without dropout (so the RNG state must come back
too). Also: --resume PATH, checkpoint.resume_from, --resume with nothing to resume
from, and checkpoint pruning with the `latest` pointer.

Each run is a tiny GPT (tests/integration/configs/tiny_gpt.yaml) on a generated
token file, one process, OMP_NUM_THREADS=1, a metrics record every step. Losses
are compared as the JSON numbers the trainer wrote (shortest round-trip form, so
float equality here is bitwise equality there).
"""
import math

import pytest

CONFIG = "tiny_gpt.yaml"
STEPS, CUT = 40, 20


def overrides(tokens, run_dir, dropout, *more):
    return ("--vars.data", tokens, "--checkpoint.save_dir", run_dir / "ckpt",
            "--model.args.dropout", dropout, *more)


@pytest.fixture(scope="module")
def straight(nnstrain, tiny_tokens, tmp_path_factory):
    """The uninterrupted 40-step runs, by dropout; made once per module."""
    cache = {}

    def get(dropout):
        if dropout not in cache:
            d = tmp_path_factory.mktemp(f"straight_{dropout}")
            cache[dropout] = nnstrain(CONFIG, *overrides(tiny_tokens, d, dropout), run_dir=d)
        return cache[dropout]
    return get


def assert_same_steps(got, want, steps, what):
    """Loss, lr and grad norm of `steps` identical in two runs' records."""
    g = {r["step"]: r for r in got.train}
    w = {r["step"]: r for r in want.train}
    for s in steps:
        assert s in g, f"{what}: step {s} missing from metrics.jsonl"
        for key in ("loss", "lr", "grad_norm"):
            assert g[s][key] == w[s][key], (
                f"{what}: step {s} {key} {g[s][key]!r} != uninterrupted run's {w[s][key]!r}")


def test_straight_run_learns_and_logs_every_step(straight):
    run = straight(0.0)
    losses = run.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values())
    # The data is a sparse Markov chain: 40 steps must get well below uniform (log 64 = 4.16).
    assert losses[1] > 3.8 and losses[STEPS] < losses[1] - 0.5, losses
    assert [r["step"] for r in run.val] == [10, 20, 30, 40]
    for r in run.train:
        assert r["tokens_per_s"] > 0 and r["lr"] > 0 and r["grad_norm"] > 0


def test_dropout_changes_the_losses(straight):
    # Otherwise the dropout case below would not test that the RNG state is restored.
    a, b = straight(0.0).losses(), straight(0.1).losses()
    assert a[1] != b[1]
    assert sum(a[s] != b[s] for s in a) == STEPS


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resume_is_bitwise_exact(nnstrain, tiny_tokens, tmp_path, straight, dropout):
    want = straight(dropout)
    d = tmp_path / "split"
    first = nnstrain(CONFIG, *overrides(tiny_tokens, d, dropout), "--max_train_steps", CUT, run_dir=d)
    assert sorted(first.losses()) == list(range(1, CUT + 1))
    assert (d / "ckpt" / "step-00000020" / "manifest.json").is_file()

    # Same run_dir: the resumed run appends to metrics.jsonl.
    second = nnstrain(CONFIG, *overrides(tiny_tokens, d, dropout), "--max_train_steps", STEPS, run_dir=d,
                      resume=True)
    assert "at step 20" in second.output, second.output
    losses = second.losses()  # also asserts no step was logged twice
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_same_steps(second, want, range(1, STEPS + 1), f"dropout {dropout}, resumed at {CUT}")
    assert [(r["step"], r["val_loss"]) for r in second.val] == [(r["step"], r["val_loss"]) for r in want.val]


@pytest.fixture(scope="module")
def periodic(nnstrain, tiny_tokens, tmp_path_factory):
    """A 40-step run (dropout 0.1) checkpointing every 10 steps, nothing pruned."""
    d = tmp_path_factory.mktemp("periodic")
    run = nnstrain(CONFIG, *overrides(tiny_tokens, d, 0.1, "--checkpoint.every_n_train_steps", 10), run_dir=d)
    return d, run


def test_periodic_checkpoints_do_not_perturb_training(periodic, straight):
    d, run = periodic
    assert_same_steps(run, straight(0.1), range(1, STEPS + 1), "run saving every 10 steps")
    saved = sorted(p.name for p in (d / "ckpt").iterdir() if p.is_dir())
    assert saved == [f"step-{s:08d}" for s in (10, 20, 30, 40)]


@pytest.mark.parametrize("how", ["--resume PATH", "checkpoint.resume_from"])
def test_resume_from_an_explicit_checkpoint(nnstrain, tiny_tokens, tmp_path, periodic, straight, how):
    # Step 20 of a run whose newest checkpoint is 40: only an explicit path reaches it.
    src = periodic[0] / "ckpt" / "step-00000020"
    d = tmp_path / "from20"
    if how == "--resume PATH":
        run = nnstrain(CONFIG, *overrides(tiny_tokens, d, 0.1), run_dir=d, resume=src)
    else:
        run = nnstrain(CONFIG, *overrides(tiny_tokens, d, 0.1, "--checkpoint.resume_from", src), run_dir=d)
    assert "at step 20" in run.output, run.output
    assert sorted(run.losses()) == list(range(CUT + 1, STEPS + 1))
    assert_same_steps(run, straight(0.1), range(CUT + 1, STEPS + 1), f"resumed via {how}")


def test_resume_with_no_checkpoint_yet_starts_fresh(nnstrain, tiny_tokens, tmp_path, straight):
    d = tmp_path / "fresh"
    assert not (d / "ckpt").exists()
    run = nnstrain(CONFIG, *overrides(tiny_tokens, d, 0.1), "--max_train_steps", 10, run_dir=d, resume=True)
    assert "starting fresh" in run.output, run.output
    assert sorted(run.losses()) == list(range(1, 11))
    assert_same_steps(run, straight(0.1), range(1, 11), "--resume with no checkpoint")


def test_keep_last_n_prunes_and_latest_points_at_newest(nnstrain, tiny_tokens, tmp_path):
    d = tmp_path / "prune"
    nnstrain(CONFIG, *overrides(tiny_tokens, d, 0.0, "--checkpoint.every_n_train_steps", 10,
                                "--checkpoint.keep_last_n_checkpoints", 2), run_dir=d)
    ckpt = d / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000030", "step-00000040"]
    assert (ckpt / "latest").read_text().strip() == "step-00000040"

    # A bare --resume follows `latest`: training goes on from step 40.
    more = nnstrain(CONFIG, *overrides(tiny_tokens, d, 0.0, "--checkpoint.every_n_train_steps", 10,
                                       "--checkpoint.keep_last_n_checkpoints", 2),
                    "--max_train_steps", 50, run_dir=d, resume=True)
    assert "at step 40" in more.output, more.output
    assert sorted(more.losses()) == list(range(1, 51))
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000040", "step-00000050"]
    assert (ckpt / "latest").read_text().strip() == "step-00000050"
