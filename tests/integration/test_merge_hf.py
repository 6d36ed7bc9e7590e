"""`nnstrain merge CKPT --out DIR [--hf]` through the binary (tiny GPT, CPU, Gloo).

- a dp=2 run saved sharded and one saved deduped merge to byte-identical model and
  optimizer files; a dp=1 run with the same global batch agrees within float
  tolerance, and so does ZeRO-1 dp=2;
- the merged folder is an nnstrain checkpoint: --resume DIR works under another
  plan, and from the same plan gives bitwise the losses of resuming the original;
- --hf: GPT2LMHeadModel.from_pretrained(DIR) loads it, and its validation loss on
  the trainer's validation batches is the one nnstrain logged at that step;
- memory: the merge process's peak RSS (VmHWM, via wait4) grows with the largest
  tensor, not with the model: measured against a merge of a tiny checkpoint;
- CLI errors: usage (status 2), a missing or incomplete checkpoint, an existing DIR.
"""
import json
import os
import pathlib
import struct
import subprocess

import numpy as np
import pytest

from conftest import CONFIGS, SOURCE, Run, nnstrain_bin_path, read_metrics, single_process_env

CONFIG = CONFIGS / "tiny_gpt.yaml"
STEPS = 10
PLANS = {
    "dp1": (1, ["--micro_batch_size", 8]),
    "dp2": (2, []),
    "dp2_zero": (2, ["--compute_config.use_zero", "true"]),
}


def train(plan, tokens, d, *more, resume=None):
    nproc, extra = PLANS[plan]
    args = [nnstrain_bin_path()]
    if nproc > 1:
        args += ["launch", "--nproc-per-node", str(nproc), "--"]
    args += ["--config", str(CONFIG), "--run_dir", str(d), "--vars.data", str(tokens),
             "--checkpoint.save_dir", str(d / "ckpt"), *[str(x) for x in extra + list(more)]]
    if resume is not None:
        args += ["--resume", str(resume)]
    p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=240)
    tr, val = read_metrics(d / "metrics.jsonl")
    run = Run(args, p.returncode, p.stdout, p.stderr, tr, val)
    assert p.returncode == 0, f"{' '.join(args)}\n{run.output}"
    return run


def merge(*args, check=True):
    """Runs `nnstrain merge ARGS`; returns (exit status, output, peak RSS in bytes)."""
    p = subprocess.Popen([nnstrain_bin_path(), "merge", *[str(a) for a in args]], env=single_process_env(1),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _, status, usage = os.wait4(p.pid, 0)  # this child's own rusage: ru_maxrss is its VmHWM
    p.returncode = os.waitstatus_to_exitcode(status)
    out = p.stdout.read()
    if check:
        assert p.returncode == 0, out
    return p.returncode, out, usage.ru_maxrss * 1024


def tensors(path):
    """A safetensors file as {name: numpy array} (F32 and U8 only, which is all we write)."""
    raw = pathlib.Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        dtype = {"F32": "<f4", "U8": "u1"}[e["dtype"]]
        out[name] = np.frombuffer(raw[8 + n + b:8 + n + end], dtype=dtype).reshape(e["shape"])
    return out


@pytest.fixture(scope="module")
def runs(tiny_tokens, tmp_path_factory):
    """10-step runs (checkpoint at the end) by plan and save type, made once."""
    cache = {}

    def get(plan, save_type="sharded"):
        key = (plan, save_type)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{plan}_{save_type}")
            run = train(plan, tiny_tokens, d, "--max_train_steps", STEPS, "--checkpoint.save_type", save_type)
            cache[key] = (run, d / "ckpt" / f"step-{STEPS:08d}")
        return cache[key]
    return get


@pytest.fixture(scope="module")
def merged(runs, tmp_path_factory):
    cache = {}

    def get(plan, save_type="sharded", hf=False):
        key = (plan, save_type, hf)
        if key not in cache:
            out = tmp_path_factory.mktemp("merged") / f"{plan}_{save_type}{'_hf' if hf else ''}"
            merge(runs(plan, save_type)[1], "--out", out, *(["--hf"] if hf else []))
            cache[key] = out
        return cache[key]
    return get


def test_sharded_and_deduped_merge_to_the_same_bytes(runs, merged):
    a, b = merged("dp2", "sharded"), merged("dp2", "deduped")
    for f in ("model.safetensors", "optimizer.safetensors", "state.safetensors"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    # A complete checkpoint of whole tensors, and its readable side files.
    m = json.loads((a / "manifest.json").read_text())
    assert m["world_size"] == 1 and m["save_type"] == "merged" and m["step"] == STEPS
    assert m["merged_from"]["world_size"] == 2
    for f, entries in m["files"].items():
        for e in entries:
            assert e["offsets"] == [0] * len(e["shape"]) and e["shape"] == e["global_shape"]
            assert "flat_range" not in e
    assert json.loads((a / "trainer_state.json").read_text()) == m["state"]
    assert (a / "config.yaml").read_text() == m["state"]["config"]
    model = tensors(a / "model.safetensors")
    assert "wte.weight" in model and "h.1.mlp.c_fc.weight" in model
    optim = tensors(a / "optimizer.safetensors")
    assert set(optim) == {f"exp_avg/{k}" for k in model} | {f"exp_avg_sq/{k}" for k in model}
    assert set(tensors(a / "state.safetensors")) == {"rng/cpu/rank0", "rng/cpu/rank1"}


@pytest.mark.parametrize("plan", ["dp1", "dp2_zero"])
def test_merged_weights_agree_across_plans(merged, plan):
    ref = merged("dp2", "sharded")
    got = merged(plan)
    for f in ("model.safetensors", "optimizer.safetensors"):
        want, have = tensors(ref / f), tensors(got / f)
        assert set(want) == set(have)
        for k in want:
            np.testing.assert_allclose(have[k], want[k], rtol=1e-4, atol=1e-6, err_msg=f"{plan}: {f}: {k}")


def test_resume_from_merged_under_any_plan(runs, merged, tiny_tokens, tmp_path):
    src = runs("dp2")[1]
    plain, hf = merged("dp2"), merged("dp2", hf=True)
    more = ("--max_train_steps", STEPS + 4, "--val_every_n_train_steps", 0)
    from_original = train("dp2", tiny_tokens, tmp_path / "a", *more, resume=src)
    from_merged = train("dp2", tiny_tokens, tmp_path / "b", *more, resume=plain)
    assert f"resumed from {plain} at step {STEPS}" in from_merged.output
    assert from_merged.losses() == from_original.losses()  # same plan: bitwise
    one = train("dp1", tiny_tokens, tmp_path / "c", *more, resume=plain)
    one_hf = train("dp1", tiny_tokens, tmp_path / "d", *more, resume=hf)  # HF names, transposed weights
    assert one_hf.losses() == one.losses()
    for s, loss in one.losses().items():
        assert loss == pytest.approx(from_original.losses()[s], rel=1e-5)
    assert sorted(one.losses()) == list(range(STEPS + 1, STEPS + 5))


def bit_reverse64(k):
    return int(format(k, "064b")[::-1], 2)


def val_loss_hf(model_dir, tokens_path, seq_len, batch, steps):
    """The trainer's validation loss (data/token_bin.cpp val_window), computed by transformers."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    tok = np.fromfile(tokens_path, dtype="<u2").astype(np.int64)
    windows = (len(tok) - 1) // seq_len
    losses = []
    for k in range(steps):
        first = (bit_reverse64(k) * windows) >> 64
        starts = [((first + p % windows) % windows) * seq_len for p in range(batch)]
        x = torch.tensor(np.stack([tok[s:s + seq_len] for s in starts]))
        y = torch.tensor(np.stack([tok[s + 1:s + seq_len + 1] for s in starts]))
        with torch.no_grad():
            logits = model(input_ids=x).logits
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item())
    return float(np.mean(losses)), model


def test_hf_export_loads_in_transformers(runs, merged, tiny_tokens):
    run, _ = runs("dp2")
    out = merged("dp2", hf=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu"
    assert (cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["vocab_size"]) == (32, 2, 2, 64)
    names = set(tensors(out / "model.safetensors"))
    assert "transformer.h.0.attn.c_attn.weight" in names and "lm_head.weight" not in names  # tied
    assert tensors(out / "model.safetensors")["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # Conv1D
    # nnstrain logged val loss at step 10 over max_val_steps 2 batches of micro 4 x dp 2.
    want = [r["val_loss"] for r in run.val if r["step"] == STEPS]
    assert len(want) == 1
    got, model = val_loss_hf(out, tiny_tokens, seq_len=16, batch=8, steps=2)
    assert got == pytest.approx(want[0], rel=1e-5), f"transformers {got} vs nnstrain {want[0]}"
    # The exported weights are the trained ones, not an initialisation.
    ref = tensors(merged("dp2") / "model.safetensors")
    np.testing.assert_array_equal(model.transformer.wte.weight.detach().numpy(), ref["wte.weight"])
    np.testing.assert_array_equal(model.transformer.h[1].mlp.c_fc.weight.detach().numpy(),
                                  ref["h.1.mlp.c_fc.weight"].T)


def test_merge_memory_follows_the_largest_tensor_not_the_model(runs, merged, tiny_tokens, tmp_path):
    # ~27M parameters in 8 layers; the checkpoint (weights + two Adam states) ~330 MB.
    d = tmp_path / "big"
    train("dp1", tiny_tokens, d, "--max_train_steps", 1, "--val_every_n_train_steps", 0,
          "--model.args.n_layer", 8, "--model.args.n_embd", 512, "--model.args.n_head", 8,
          "--model.args.vocab_size", 4096)
    ckpt = d / "ckpt" / "step-00000001"
    _, _, base = merge(runs("dp1")[1], "--out", tmp_path / "tiny_merged")
    _, out, peak = merge(ckpt, "--out", tmp_path / "big_merged")
    sizes = [np.prod(e["shape"], dtype=np.int64) * 4 for es in
             json.loads((ckpt / "manifest.json").read_text())["files"].values() for e in es if e["dtype"] == "F32"]
    model_bytes, largest = int(sum(sizes)), int(max(sizes))
    _, _, peak_hf = merge(ckpt, "--out", tmp_path / "big_hf", "--hf")
    mib = 1 << 20
    print(f"\nmerge peak RSS: tiny checkpoint {base / mib:.0f} MiB; {model_bytes / mib:.0f} MiB checkpoint "
          f"(largest tensor {largest / mib:.1f} MiB): {peak / mib:.0f} MiB (+{(peak - base) / mib:.0f}), "
          f"with --hf {peak_hf / mib:.0f} MiB (+{(peak_hf - base) / mib:.0f})")
    assert model_bytes > 300 * mib
    # One tensor, its writer buffer and allocator slack; never the model.
    assert peak - base < 4 * largest + 48 * mib, out
    assert peak - base < model_bytes / 4
    # --hf builds the model once (weights only, a third of the checkpoint) to learn its names.
    assert peak_hf - base < model_bytes / 2


def test_merge_cli_errors(runs, tmp_path):
    rc, out, _ = merge(check=False)
    assert rc == 2 and "usage: nnstrain merge" in out
    rc, out, _ = merge(runs("dp1")[1], check=False)
    assert rc == 2 and "--out" in out
    rc, out, _ = merge(tmp_path / "nothing", "--out", tmp_path / "o", check=False)
    assert rc == 1 and "no such checkpoint folder" in out
    incomplete = tmp_path / ".tmp-step-00000003"
    incomplete.mkdir()
    rc, out, _ = merge(incomplete, "--out", tmp_path / "o", check=False)
    assert rc == 1 and "manifest.json missing" in out
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()
    (tmp_path / "taken").mkdir()
    rc, out, _ = merge(runs("dp1")[1], "--out", tmp_path / "taken", check=False)
    assert rc == 1 and "already exists" in out
    # A run's save_dir stands for its latest checkpoint.
    rc, out, _ = merge(runs("dp1")[1].parent, "--out", tmp_path / "from_save_dir")
    assert rc == 0 and "step-00000010" in out
