"""bf16-mixed and 16-mixed train nanoGPT's shakespeare_char CPU config
(configs/shakespeare_char_cpu.yaml, 2000 steps) as well as 32-true does.

Each run starts from the same fp32 initial weights and sees the same batches; the
16-bit runs round activations and weights differently from the first step on, so
their curves are different trajectories of the same optimisation, not copies of
the fp32 one. Tolerance: at every evaluation (every 250 steps, 20 batches) the
validation loss is within VAL_ATOL = 0.03 of 32-true's, about 1.5% of the final
loss; a lost update path (updates rounded away in bf16, a scale never undone) ends
far above it, at the loss of an untrained or barely trained model (>= 2.4 here).
The bf16-mixed run must also reach nanoGPT's bar, val loss <= 1.95.

16-mixed runs its first 500 steps only (same schedule, decay_steps is fixed in the
config): this CPU has no native fp16 matrix units, so fp16 GEMMs are emulated
and a step costs several times a bf16 or fp32 one; the curve is compared at the
evaluations it reaches (250, 500).
"""
import json
import os
import pathlib
import subprocess

import pytest

from conftest import SOURCE, nnstrain_bin_path, single_process_env

CONFIG = SOURCE / "configs" / "shakespeare_char_cpu.yaml"
VAL_ATOL = 0.03
MODES = {"32-true": 2000, "bf16-mixed": 2000, "16-mixed": 500}  # mode: steps


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("shakespeare_char")
    p = subprocess.run([nnstrain_bin_path(), "prepare", "shakespeare_char", "--out", str(out)], cwd=SOURCE,
                       capture_output=True, text=True, env=single_process_env(), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


@pytest.fixture(scope="module")
def curves(data, tmp_path_factory):
    out = {}
    for mode, steps in MODES.items():
        run_dir = tmp_path_factory.mktemp(mode)
        p = subprocess.run([nnstrain_bin_path(), "--config", str(CONFIG), "--vars.data_dir", str(data),
                            "--run_dir", str(run_dir), "--precision", mode, "--checkpoint.save_dir", "",
                            "--checkpoint.every_n_train_steps", "0", "--max_train_steps", str(steps)],
                           cwd=SOURCE, capture_output=True, text=True, env=single_process_env(), timeout=1200)
        assert p.returncode == 0, p.stdout + p.stderr
        recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
        out[mode] = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
        print(f"\n{mode}: " + ", ".join(f"{s}: {v:.4f}" for s, v in sorted(out[mode].items())))
    return out


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
def test_val_curve_follows_fp32(curves, mode):
    got, ref = curves[mode], curves["32-true"]
    assert sorted(ref) == list(range(250, 2001, 250))
    assert sorted(got) == list(range(250, MODES[mode] + 1, 250))
    diffs = {s: got[s] - ref[s] for s in got}
    print(f"\n{mode} - 32-true: " + ", ".join(f"{s}: {d:+.4f}" for s, d in sorted(diffs.items())))
    assert all(abs(d) <= VAL_ATOL for d in diffs.values()), diffs
    assert ref[2000] < ref[250] - 0.3  # the comparison is over a real learning curve


def test_bf16_mixed_reaches_nanogpt_bar(curves):
    assert curves["bf16-mixed"][2000] <= 1.95, curves["bf16-mixed"]
