"""models/common/kernels (issue 20): a 20-step GPT and Llama run with every
kernel's fused form forced (NNSTRAIN_KERNELS=fused: rms_norm_cpu on the CPU,
native LayerNorm and GELU, silu + mul_, rotary in place) equals the run with
every composite forced (NNSTRAIN_KERNELS=composite) on CPU: loss and gradient
norm of every step within 1e-5; an unknown value is refused with status 2.

The two runs differ only in rounding, so the losses cannot show which forms
ran: each run's record (run_dir/active/rank0.json) counts the forms its
kernels dispatched in the first step, and the test reads that.
"""
import json
import subprocess

import pytest

from conftest import CONFIGS, SOURCE, device_args, nnstrain_bin_path, read_metrics, single_process_env

STEPS = 20
TOL = 1e-5
LLAMA = ["--model.type", "llama", "--model.args",
         "{vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
         "num_key_value_heads: 2, max_position_embeddings: 16, tie_word_embeddings: false}"]


def run(tmp_path, name, kernels, tokens, extra):
    d = tmp_path / name
    args = [nnstrain_bin_path(), "--config", str(CONFIGS / "tiny_gpt.yaml"), "--run_dir", str(d), "--vars.data",
            str(tokens), "--max_train_steps", str(STEPS), "--val_every_n_train_steps", "0", *device_args(1), *extra]
    p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1, NNSTRAIN_KERNELS=kernels), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    train, _ = read_metrics(d / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert_kernels_ran(d, kernels, KERNELS[model_of(extra)])
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in train}


# The kernels each model calls (models/common/kernels/kernels.h).
KERNELS = {"gpt": ("layer_norm", "gelu"), "llama": ("rms_norm", "swiglu", "rotary")}


def model_of(extra):
    return "llama" if "llama" in extra else "gpt"


def assert_kernels_ran(run_dir, form, used):
    """The record says every kernel call of the first step dispatched `form`, and each kernel the model uses ran."""
    rec = json.loads((run_dir / "active" / "rank0.json").read_text())
    assert rec["kernels"] == form, rec["kernels"]
    calls = rec["first_step"]["kernels"]
    other = "composite" if form == "fused" else "fused"
    assert all(c[other] == 0 for c in calls.values()), f"NNSTRAIN_KERNELS={form}, yet {other} forms ran: {calls}"
    assert all(calls[k][form] > 0 for k in used), f"NNSTRAIN_KERNELS={form}: {used} did not all run: {calls}"


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("model,extra", [("gpt", []), ("llama", LLAMA)])
def test_fused_kernels_run_equals_composites(tmp_path, tiny_tokens, model, extra):
    a = run(tmp_path, "composite", "composite", tiny_tokens, extra)
    b = run(tmp_path, "fused", "fused", tiny_tokens, extra)
    worst_loss = max(rel(b[s][0], a[s][0]) for s in a)
    worst_norm = max(rel(b[s][1], a[s][1]) for s in a)
    print(f"{model}: fused kernels vs composites over {STEPS} steps: loss {worst_loss:.2e}, grad norm {worst_norm:.2e}")
    assert worst_loss < TOL and worst_norm < TOL
    assert a[STEPS][0] < a[1][0] - 0.1  # it trained


def test_unknown_kernels_value_is_refused(tmp_path, tiny_tokens):
    p = subprocess.run([nnstrain_bin_path(), "--config", str(CONFIGS / "tiny_gpt.yaml"), "--run_dir",
                        str(tmp_path / "r"), "--vars.data", str(tiny_tokens)], cwd=SOURCE,
                       env=single_process_env(1, NNSTRAIN_KERNELS="fast"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "NNSTRAIN_KERNELS" in p.stderr and "fast" in p.stderr, p.stderr
