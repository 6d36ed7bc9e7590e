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
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import CONFIGS, SOURCE, Run, nnstrain_bin_path, read_metrics, single_process_env, train_window_starts

CONFIG = CONFIGS / "tiny_gpt.yaml"
STEPS = 10
PLANS = {
    "dp1": (1, ["--micro_batch_size", 8]),
    "dp2": (2, []),
    "dp2_zero": (2, ["--compute_config.use_zero", "true"]),
    "dp4_zero3": (4, ["--micro_batch_size", 2, "--compute_config.use_zero", 3]),
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


# Starts argv[1:] and prints its peak RSS. Through this small process, because Linux
# carries a process's RSS high-water mark across exec: forked straight from pytest
# (with torch and transformers loaded), the merge would report pytest's size.
PEAK_RSS = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(p.pid, 0)
print(f"MAXRSS_KB {usage.ru_maxrss}", flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def merge(*args, check=True):
    """Runs `nnstrain merge ARGS`; returns (exit status, output, peak RSS in bytes)."""
    p = subprocess.run([sys.executable, "-c", PEAK_RSS, nnstrain_bin_path(), "merge", *[str(a) for a in args]],
                       env=single_process_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    if check:
        assert p.returncode == 0, p.stdout
    m = re.search(r"MAXRSS_KB (\d+)", p.stdout)
    return p.returncode, p.stdout, int(m.group(1)) * 1024


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


@pytest.mark.parametrize("plan", ["dp1", "dp2_zero", "dp4_zero3"])
def test_merged_weights_agree_across_plans(merged, plan):
    ref = merged("dp2", "sharded")
    got = merged(plan)
    for f in ("model.safetensors", "optimizer.safetensors"):
        want, have = tensors(ref / f), tensors(got / f)
        assert set(want) == set(have)
        for k in want:
            w, h = want[k], have[k].astype(np.float64)
            if f == "model.safetensors" and k.endswith("attn.c_attn.bias"):
                # The key bias cannot change attention (softmax is shift-invariant per query),
                # so its gradient is rounding noise, which Adam scales up to lr-sized steps.
                # Compare the query and value parts.
                c = w.shape[0] // 3
                w, h = np.concatenate([w[:c], w[2 * c:]]), np.concatenate([h[:c], h[2 * c:]])
            # Float tolerance relative to the tensor's scale (Adam's moments hold entries near 0).
            assert np.abs(w).max() > 0, f"{plan}: {f}: {k} is all zeros"
            err = np.abs(h - w).max() / np.abs(w).max()
            assert err < 1e-4, f"{plan}: {f}: {k}: max error {err:.3g} of the tensor's scale"


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


def write_synthetic_checkpoint(folder, count, rows, cols):
    """A dp=2 ZeRO-style checkpoint of `count` [rows, cols] F32 tensors, each cut at an odd
    element between rank 0 and rank 1, written one tensor at a time. Tensor i holds
    (arange % 1000) + i, so any of it can be checked after merging."""
    folder.mkdir(parents=True)
    numel = rows * cols
    files = {}
    for rank in (0, 1):
        entries, header, offset = [], {}, 0
        for i in range(count):
            cut = 1 + (i * 7919) % (numel - 1)
            lo, hi = (0, cut) if rank == 0 else (cut, numel)
            header[f"model/layer{i}.weight"] = {"dtype": "F32", "shape": [hi - lo],
                                                "data_offsets": [offset, offset + 4 * (hi - lo)]}
            offset += 4 * (hi - lo)
            entries.append({"name": f"model/layer{i}.weight", "dtype": "F32", "global_shape": [rows, cols],
                            "offsets": [0, 0], "shape": [rows, cols], "flat_range": [lo, hi],
                            "replica_ranks": [rank]})
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        with open(folder / f"rank-0000{rank}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h)
            for i in range(count):
                cut = 1 + (i * 7919) % (numel - 1)
                lo, hi = (0, cut) if rank == 0 else (cut, numel)
                f.write(((np.arange(lo, hi) % 1000) + i).astype("<f4").tobytes())
        files[f"rank-0000{rank}.safetensors"] = entries
    manifest = {"format": "nnstrain-checkpoint", "version": 1, "step": 1, "world_size": 2, "save_type": "sharded",
                "files": files, "rank_states": {"0": {}, "1": {}}, "state": {"step": 1, "model_type": "synthetic"}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return count * numel * 4, numel * 4


def test_merge_memory_follows_the_largest_tensor_not_the_model(runs, tmp_path):
    # 96 tensors of 8 MiB: a 768 MiB checkpoint, more than the process's startup peak
    # (LibTorch's libraries), so holding the model would show.
    count, rows, cols = 96, 2048, 1024
    model_bytes, largest = write_synthetic_checkpoint(tmp_path / "big", count, rows, cols)
    _, _, base = merge(runs("dp1")[1], "--out", tmp_path / "tiny_merged")
    _, out, peak = merge(tmp_path / "big", "--out", tmp_path / "big_merged")
    mib = 1 << 20
    print(f"\nmerge peak RSS (VmHWM): {base / mib:.0f} MiB for a tiny checkpoint; {peak / mib:.0f} MiB "
          f"(+{(peak - base) / mib:.0f}) for {model_bytes / mib:.0f} MiB in {count} tensors of {largest / mib:.0f} MiB")
    # One tensor, the writer's buffer and allocator slack; never the model.
    assert peak - base < 2 * largest + 48 * mib, out
    # The merged tensors are whole and right (spot checks through a memory map).
    raw = np.memmap(tmp_path / "big_merged" / "model.safetensors", dtype=np.uint8, mode="r")
    n = int(raw[:8].view("<u8")[0])
    header = json.loads(bytes(raw[8:8 + n]))
    assert header["__metadata__"]["format"] == "pt"
    for i in (0, 1, count // 2, count - 1):
        e = header[f"layer{i}.weight"]
        assert e["shape"] == [rows, cols]
        b, end = e["data_offsets"]
        got = raw[8 + n + b:8 + n + end].view("<f4")
        np.testing.assert_array_equal(got, (np.arange(rows * cols) % 1000 + i).astype("<f4"))


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


def train_batch(tokens_path, seed, step, count, seq_len):
    """The trainer's batch of `step` (data/token_bin.cpp window_start), as (x, y)."""
    tok = np.fromfile(tokens_path, dtype="<u2").astype(np.int64)
    starts = train_window_starts(len(tok), seed, step, count, seq_len)
    return (np.stack([tok[s:s + seq_len] for s in starts]), np.stack([tok[s + 1:s + seq_len + 1] for s in starts]))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_init_from_a_transformers_save_pretrained(tiny_tokens, tmp_path, layout):
    """model.init_from: nnstrain's first loss is transformers' loss on the same batch."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(11)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, activation_function="gelu",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).float().eval()
    with torch.no_grad():  # gains and biases random too, so a misplaced one shows
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("ln_1.weight") or name.endswith("ln_2.weight")
                    or name.endswith("ln_f.weight") else 0.05 * torch.randn_like(p))
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir, **({"max_shard_size": "20KB"} if layout == "sharded" else {}))
    assert (hf_dir / ("model.safetensors.index.json" if layout == "sharded" else "model.safetensors")).is_file()
    x, y = train_batch(tiny_tokens, seed=1337, step=0, count=4, seq_len=16)  # tiny_gpt.yaml: seed, micro 4
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(x)).logits
    want = F.cross_entropy(logits.reshape(-1, 64), torch.tensor(y).reshape(-1)).item()

    d = tmp_path / "run"
    run = train("dp1", tiny_tokens, d, "--micro_batch_size", 4, "--max_train_steps", 1,
                "--val_every_n_train_steps", 0, "--model.init_from", hf_dir)
    assert f"initialised weights from {hf_dir}" in run.output
    assert run.losses()[1] == pytest.approx(want, rel=1e-5), f"nnstrain {run.losses()[1]} vs transformers {want}"
    # ZeRO-3 over 2 ranks reads each parameter into its chunks one at a time: the same batch, the same loss.
    run = train("dp2", tiny_tokens, tmp_path / "run_zero3", "--micro_batch_size", 2, "--max_train_steps", 1,
                "--val_every_n_train_steps", 0, "--model.init_from", hf_dir, "--compute_config.use_zero", 3)
    assert run.losses()[1] == pytest.approx(want, rel=1e-5), f"ZeRO-3: nnstrain {run.losses()[1]} vs transformers {want}"
    # model.args that disagree with the folder's config.json (issue 51): exit 2 naming the key and the file.
    args = [nnstrain_bin_path(), "--config", str(CONFIG), "--run_dir", str(tmp_path / "bad"),
            "--vars.data", str(tiny_tokens), "--model.init_from", str(hf_dir), "--model.args.n_embd", "48"]
    p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "model.args.n_embd" in p.stderr and "config.json has 32" in p.stderr, p.stderr
