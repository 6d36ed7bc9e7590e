"""Precision modes (docs/precision.md): bf16/fp16 compute with fp32 masters, the
fp16 loss scaler, the non-finite guard, checkpoints across precisions.

Runs: the data-parallel tests' tiny GPT (configs/tiny_dp.yaml: 2 layers, n_embd 32,
several reducer buckets, clip_gnorm active at some steps) on one CPU thread per
process; dp > 1 through `nnstrain launch` with Gloo.

The bf16 parity tolerance. dp=2 and dp=1 with the same global batch compute the
same sums in a different order: each rank's weight gradient comes out of a bf16
matrix product rounded once to bf16 (relative error <= 2^-9) before the fp32
all-reduce, where dp=1 rounds the whole batch's gradient once. Adam normalises the
update, so a relative gradient error e moves each weight by about lr * e, and the
bf16 working copy, re-rounded from the fp32 masters, flips by one ulp where the
master sits near a rounding boundary. Over 10 steps the loss (an fp32 mean of
fp32 log-sum-exps over bf16 logits) stays within one bf16 ulp of relative error:
BF16_RTOL = 2^-8 = 3.9e-3. The comparison is meaningful only if bf16 differs from
fp32 by more than the fp32 parity tolerance (1e-5), which the test asserts.
"""
import json
import os
import pathlib
import re
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import PARAM_DTYPE, REDUCE_DTYPE, STATE_ELEMENT_BYTES, TEST_DEVICE, active_records, assert_active, device_args

HERE = pathlib.Path(__file__).resolve().parent
CONFIG = HERE / "configs" / "tiny_dp.yaml"
SOURCE = pathlib.Path(os.environ.get("NNSTRAIN_SOURCE_DIR", HERE.parents[1]))
STEPS = 10
BF16_RTOL = 2.0 ** -8


def job_env(**extra):
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NNSTRAIN_TEST_NONFINITE_AT")
    prefixes = ("SLURM_", "PBS_", "PALS_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(prefixes)}
    env["OMP_NUM_THREADS"] = "1"
    if TEST_DEVICE == "cuda":
        env["NNSTRAIN_SHARE_DEVICES"] = "1"  # several test ranks on a machine's one GPU
    env.update(extra)
    return env


def records(run_dir):
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def by_step(recs, key):
    return {r["step"]: r[key] for r in recs if key in r and "val_loss" not in r}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.fixture(scope="module")
def train(tiny_tokens, tmp_path_factory):
    """train(name, nproc, *overrides, env=None, check=True, resume=None, run_dir=None) -> (proc, run_dir)."""
    binary = os.environ.get("NNSTRAIN_BIN")
    if not binary or not os.access(binary, os.X_OK):
        pytest.fail(f"NNSTRAIN_BIN={binary!r} is not an executable nnstrain binary")

    def run(name, nproc, *overrides, env=None, check=True, resume=None, run_dir=None):
        run_dir = run_dir or tmp_path_factory.mktemp(name)
        args = ["--config", str(CONFIG), "--vars.data", str(tiny_tokens), "--run_dir", str(run_dir),
                "--max_train_steps", str(STEPS), *device_args(nproc), *map(str, overrides)]
        if resume is not None:
            args += ["--resume", str(resume)]
        cmd = [binary, *args] if nproc == 1 else [binary, "launch", "--nproc-per-node", str(nproc), "--", *args]
        p = subprocess.run(cmd, cwd=SOURCE, env=job_env(**(env or {})), capture_output=True, text=True, timeout=180)
        if check and p.returncode != 0:
            pytest.fail(f"{name}: exit {p.returncode}: {' '.join(cmd)}\n{p.stdout}{p.stderr}")
        return p, pathlib.Path(run_dir)
    return run


@pytest.fixture(scope="module")
def runs(train):
    cache = {}

    def get(name):
        if name not in cache:
            spec = {
                "fp32_dp1_b8": (1, "32-true", 8, ()),
                "bf16_dp1_b8": (1, "bf16-mixed", 8, ()),
                "bf16_dp2_b4": (2, "bf16-mixed", 4, ()),
                "bf16_dp2_b4_zero": (2, "bf16-mixed", 4, ("--compute_config.use_zero", "true")),
                "bf16_dp2_b4_zero2": (2, "bf16-mixed", 4, ("--compute_config.use_zero", "2")),
                "bf16_dp2_b4_zero3": (2, "bf16-mixed", 4, ("--compute_config.use_zero", "3")),
                "bf16_dp4_b2_zero3": (4, "bf16-mixed", 2, ("--compute_config.use_zero", "3")),
                "bf16_dp4_b2_zero3_ng2": (4, "bf16-mixed", 2, ("--compute_config.use_zero", "3",
                                                                "--compute_config.zero_ngroups", "2")),
                "bf16_tp2_dp2_b4_zero3": (4, "bf16-mixed", 4, ("--compute_config.use_zero", "3", "--pas_policy",
                                                                "hybrid", "--compute_config.plan_ngpus", "2")),
                "fp16_dp1_b8": (1, "16-mixed", 8, ()),
                "bf16true_dp1_b8": (1, "bf16-true", 8, ()),
            }[name]
            nproc, precision, micro, extra = spec
            overrides = ("--precision", precision, "--micro_batch_size", micro, *extra)
            p, d = train(name, nproc, *overrides)
            recs = records(d)
            assert sorted(by_step(recs, "loss")) == list(range(1, STEPS + 1)), p.stdout + p.stderr
            # The run held its state in the mode's dtypes and ran the plan asked for.
            assert_active(d, p.stdout + p.stderr, nproc, overrides)
            cache[name] = (p, recs)
        return cache[name]
    return get


@pytest.mark.parametrize("name", ["bf16_dp2_b4", "bf16_dp2_b4_zero", "bf16_dp2_b4_zero2", "bf16_dp2_b4_zero3",
                                  "bf16_dp4_b2_zero3", "bf16_dp4_b2_zero3_ng2", "bf16_tp2_dp2_b4_zero3"])
def test_bf16_mixed_data_parallel_equals_one_process(runs, name):
    _, got = runs(name)
    _, want = runs("bf16_dp1_b8")
    _, fp32 = runs("fp32_dp1_b8")
    gl, wl, fl = by_step(got, "loss"), by_step(want, "loss"), by_step(fp32, "loss")
    worst = max(rel(gl[s], wl[s]) for s in gl)
    print(f"\n{name} vs bf16_dp1_b8: max rel loss diff {worst:.3g} (tolerance {BF16_RTOL:.3g})")
    assert worst <= BF16_RTOL, {s: (gl[s], wl[s]) for s in gl}
    gn, wn = by_step(got, "grad_norm"), by_step(want, "grad_norm")
    worst_gn = max(rel(gn[s], wn[s]) for s in gn)
    print(f"{name} vs bf16_dp1_b8: max rel grad norm diff {worst_gn:.3g}")
    assert worst_gn <= 4 * BF16_RTOL, {s: (gn[s], wn[s]) for s in gn}
    # Meaningful: bf16 really computes in bf16 (it differs from fp32 beyond fp32 parity) and training moved.
    assert max(rel(wl[s], fl[s]) for s in wl) > 1e-5
    assert wl[STEPS] < wl[1] - 0.05


@pytest.mark.parametrize("name", ["bf16_dp1_b8", "fp16_dp1_b8", "bf16true_dp1_b8"])
def test_low_precision_follows_fp32(runs, name):
    # Same weights at step 0, same data: every low-precision curve stays near fp32's.
    # 16-bit rounding of activations and weights moves each loss by well under 1%
    # over 10 steps of a model this size; a wrong master/gradient path (e.g. updates
    # lost to bf16 rounding, a missing unscale) moves it by far more.
    _, got = runs(name)
    _, fp32 = runs("fp32_dp1_b8")
    gl, fl = by_step(got, "loss"), by_step(fp32, "loss")
    worst = max(rel(gl[s], fl[s]) for s in gl)
    print(f"\n{name} vs fp32: max rel loss diff {worst:.3g}")
    assert worst < 0.01, {s: (gl[s], fl[s]) for s in gl}
    assert gl[STEPS] < gl[1] - 0.05
    # ... and it is not fp32: 16-bit rounding moves the curve by more than fp32's
    # own rounding (the fp32 parity tolerance), as an ignored --precision would not.
    assert worst > 1e-5, f"{name} equals fp32 to {worst:.2e}: was the precision applied?"


def state_bytes_line(output):
    m = re.search(r"state bytes/param ([\d.]+) \(param ([\d.]+), grad ([\d.]+), master ([\d.]+), moments ([\d.]+)\)",
                  output)
    assert m, output
    return [float(x) for x in m.groups()]


@pytest.mark.parametrize("name,expect", [
    ("fp32_dp1_b8", [16, 4, 4, 0, 8]),
    ("bf16_dp1_b8", [18, 2, 4, 4, 8]),
    ("fp16_dp1_b8", [18, 2, 4, 4, 8]),
    ("bf16true_dp1_b8", [8, 2, 2, 0, 4]),
])
def test_bytes_per_param_measured_match_the_planner(runs, name, expect, tiny_tokens):
    p, _ = runs(name)
    measured = state_bytes_line(p.stdout + p.stderr)
    precision = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16true": "bf16-true"}[name.split("_")[0]]
    plan = subprocess.run([os.environ["NNSTRAIN_BIN"], "plan", "--config", str(CONFIG), "--vars.data", str(tiny_tokens),
                           "--precision", precision, "--json"], cwd=SOURCE, env=job_env(),
                          capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    sb = json.loads(plan.stdout)["state_bytes_per_param"]
    planned = [sb["total"], sb["param"], sb["grad"], sb["master"], sb["moments"]]
    # dp=1, no ZeRO: what the rank holds is exactly the planner's per-element model.
    assert measured == pytest.approx(planned, abs=0.01), (measured, planned)
    assert planned == pytest.approx(expect)


def model_tensors(ckpt):
    out = {}
    for f in sorted(pathlib.Path(ckpt).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            out[(f.name, k)] = v
    return out


def test_fp16_scaler_skips_a_nonfinite_step_on_every_rank(train, tmp_path):
    # Rank 1's gradients at step 3 are non-finite; the reduced gradients then are on
    # every rank, so every rank skips; the scale backs off; weights and moments are
    # bitwise those of step 2. growth_interval 2 then grows it again after steps 4, 5.
    p, d = train("fp16_skip", 2, "--precision", "16-mixed", "--micro_batch_size", 4,
                 "--loss_scaler.init_scale", 1024, "--loss_scaler.growth_interval", 2,
                 "--checkpoint.save_dir", tmp_path / "ckpt", "--checkpoint.every_n_train_steps", 1,
                 "--max_train_steps", 6, env={"NNSTRAIN_TEST_NONFINITE_AT": "3:1"})
    recs = records(d)
    scale, skipped = by_step(recs, "loss_scale"), by_step(recs, "skipped_steps")
    assert [scale[s] for s in range(1, 7)] == [1024, 2048, 1024, 1024, 2048, 2048], scale
    assert [skipped[s] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1], skipped
    ck = tmp_path / "ckpt"
    s2, s3, s4 = (model_tensors(ck / f"step-0000000{i}") for i in (2, 3, 4))
    assert s2.keys() == s3.keys() and len({f for f, _ in s2}) == 2, list(s2)  # both ranks' files
    for key in s2:
        if not key[1].startswith("amp/"):  # the scale itself backs off, as checked above
            assert np.array_equal(s2[key], s3[key]), f"{key} changed in the skipped step"
    # ... and the step after it did update (the comparison can fail).
    assert any(not np.array_equal(s3[k], s4[k]) for k in s3 if k[1].startswith("model/"))


def test_nonfinite_without_scaler_stops_naming_the_step(train, tmp_path):
    ck = tmp_path / "ckpt"
    p, d = train("bf16_nonfinite", 1, "--precision", "bf16-mixed", "--micro_batch_size", 8,
                 "--checkpoint.save_dir", ck, "--checkpoint.every_n_train_steps", 2,
                 "--log_progress_every_n_train_steps", 5, env={"NNSTRAIN_TEST_NONFINITE_AT": "3"}, check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "step 3: non-finite loss or gradient norm" in out, out
    assert "Exception raised from" not in out and "frame #" not in out, out  # one line, no backtrace
    # Step 2's checkpoint is the last one, intact; the bad step's weights were never saved.
    assert (ck / "latest").read_text().strip().endswith("step-00000002"), (ck / "latest").read_text()
    assert not (ck / "step-00000004").exists()
    assert all(np.isfinite(v).all() for v in model_tensors(ck / "step-00000002").values())


def test_bf16_mixed_resume_is_bitwise(train, tmp_path):
    common = ("--precision", "bf16-mixed", "--micro_batch_size", 4)
    _, straight = train("bf16_straight", 1, *common)
    ck = tmp_path / "ckpt"
    _, half = train("bf16_half", 1, *common, "--checkpoint.save_dir", ck, "--max_train_steps", 5,
                    "--lr_scheduler.args.decay_steps", 10)
    _, rest = train("bf16_rest", 1, *common, "--checkpoint.save_dir", ck, resume=ck / "step-00000005")
    a, b = by_step(records(straight), "loss"), by_step(records(rest), "loss")
    assert sorted(b) == list(range(6, STEPS + 1)), b
    for s in b:
        assert a[s] == b[s], (s, a[s], b[s])


@pytest.mark.parametrize("saved,resumed", [("bf16-mixed", "32-true"), ("32-true", "bf16-mixed"),
                                           ("bf16-true", "32-true")])
def test_resume_across_precisions(train, tmp_path, saved, resumed):
    ck = tmp_path / "ckpt"
    train("saved", 1, "--precision", saved, "--micro_batch_size", 4, "--checkpoint.save_dir", ck,
          "--max_train_steps", 5, "--lr_scheduler.args.decay_steps", 10)
    _, cont = train("resumed", 1, "--precision", resumed, "--micro_batch_size", 4, "--checkpoint.save_dir", ck,
                    resume=ck / "step-00000005")
    _, straight = train("straight", 1, "--precision", saved, "--micro_batch_size", 4)
    a, b = by_step(records(straight), "loss"), by_step(records(cont), "loss")
    assert sorted(b) == list(range(6, STEPS + 1))
    # The fp32 weights carried over: step 6 continues the saved run's curve (a fresh
    # start would be back near the step-1 loss).
    assert rel(b[6], a[6]) < 0.01, (a, b)
    assert abs(b[6] - a[6]) < 0.2 * abs(a[1] - a[6]), (a, b)


def test_merge_writes_the_chosen_dtype(train, tmp_path):
    ck = tmp_path / "ckpt"
    train("merge_src", 2, "--precision", "bf16-mixed", "--micro_batch_size", 4, "--checkpoint.save_dir", ck,
          "--compute_config.use_zero", "true", "--max_train_steps", 3)
    from safetensors import safe_open
    for flag, want in ((None, "F32"), ("bf16", "BF16"), ("fp16", "F16"), ("fp32", "F32")):
        out = tmp_path / f"merged_{flag}"
        cmd = [os.environ["NNSTRAIN_BIN"], "merge", str(ck / "step-00000003"), "--out", str(out)]
        if flag:
            cmd += ["--dtype", flag]
        p = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        with safe_open(str(out / "model.safetensors"), "np") as f:
            header = json.loads((out / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
                (out / "model.safetensors").read_bytes()[:8], "little")])
            dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
            assert dtypes == {want}, (flag, dtypes)
            if flag is None:
                master = {k: f.get_tensor(k) for k in f.keys()}
    # The default keeps the fp32 masters, which are not bf16 values (training moved them off the bf16 grid).
    w = master["h.0.mlp.c_fc.weight"]
    as_bf16 = (w.view(np.uint32) & 0xFFFF) == 0
    assert not as_bf16.all()
    bad = subprocess.run([os.environ["NNSTRAIN_BIN"], "merge", str(ck / "step-00000003"), "--out",
                          str(tmp_path / "x"), "--dtype", "int8"], capture_output=True, text=True, env=job_env())
    assert bad.returncode == 2 and "--dtype must be fp32, bf16 or fp16" in bad.stderr


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"])
def test_checkpoint_holds_the_modes_dtypes(train, tmp_path, precision):
    # Mixed modes store their fp32 masters, the -true modes the 16-bit weights they train.
    ck = tmp_path / "ckpt"
    train("dtypes", 1, "--precision", precision, "--micro_batch_size", 4, "--checkpoint.save_dir", ck,
          "--max_train_steps", 2)
    want = {"32-true": "F32", "bf16-mixed": "F32", "16-mixed": "F32", "bf16-true": "BF16", "16-true": "F16"}[precision]
    manifest = json.loads((ck / "step-00000002" / "manifest.json").read_text())
    dtypes = {e["dtype"] for entries in manifest["files"].values() for e in entries if e["name"].startswith("model/")}
    assert dtypes == {want}, (precision, dtypes)
    moments = {e["dtype"] for entries in manifest["files"].values() for e in entries
               if e["name"].startswith("optim/exp_avg")}
    assert moments == {"F32" if STATE_ELEMENT_BYTES[precision][3] == 8 else want}, (precision, moments)


# Every precision x compute_config.reduce_dtype: accepted ones train, the others are refused at load.
REDUCE = [(p, r) for p in ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
          for r in ("auto", "fp32", "bf16", "fp16")]


def _accepted(precision, reduce_dtype):
    low = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else "fp32"
    return reduce_dtype in ("auto", "fp32", low)


@pytest.mark.parametrize("precision,reduce_dtype", REDUCE, ids=[f"{p}-{r}" for p, r in REDUCE])
def test_every_precision_and_reduce_dtype_trains_or_is_refused(train, precision, reduce_dtype):
    # Two ranks under ZeRO-1, so the reduced gradient meets the partitioned masters
    # (bf16-mixed with reduce_dtype bf16 once crashed there at step 1).
    p, d = train(f"reduce_{precision}_{reduce_dtype}", 2, "--precision", precision, "--compute_config.reduce_dtype",
                 reduce_dtype, "--micro_batch_size", 4, "--compute_config.use_zero", "true", "--max_train_steps", 2,
                 check=False)
    out = p.stdout + p.stderr
    if not _accepted(precision, reduce_dtype):
        assert p.returncode == 2 and "compute_config.reduce_dtype" in out, out
        assert "Exception raised from" not in out, out
        return
    assert p.returncode == 0, out
    losses = by_step(records(d), "loss")
    assert sorted(losses) == [1, 2] and all(np.isfinite(v) for v in losses.values()), out
    # The gradients went into their reduce-scatters in that dtype (auto: fp32 under *-mixed, else the
    # parameters'), on both ranks: read from the reducer's record of its first step.
    want = REDUCE_DTYPE.get(reduce_dtype) or ("float32" if precision.endswith("-mixed") else PARAM_DTYPE[precision])
    ran = {r: rec["first_step"]["reduce_dtype"] for r, rec in active_records(d, 2).items()}
    assert ran == {0: want, 1: want}, f"{precision} reduce_dtype {reduce_dtype}: gradients reduced in {ran}, want {want}"
