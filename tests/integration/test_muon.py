"""Muon (optimizer.type: muon, trainer/optim/muon/) through the binary, CPU, Gloo.

- Parity with PyTorch's own optimizers: a transformers GPT-2 and a transformers
  Llama of odd shapes (non-square matrices of both orientations), saved by
  transformers and read by nnstrain (model.init_from), trained 20 steps in fp32
  by nnstrain (Muon for the matrices inside the blocks, AdamW for the rest) and
  in this file by torch.optim.Muon + torch.optim.AdamW on the same batches (the
  data stream's documented window starts). Losses at every step and the final
  weights (nnstrain merge --hf) agree within 1e-5 relative. nnstrain runs
  Newton-Schulz in fp32 on the CPU (docs/optimizers.md); PyTorch's Muon always
  casts to bf16, so its cast is lifted here for the comparison (its algorithm
  otherwise untouched).
- Under other plans (dp 2, dp 2 ZeRO-1, ZeRO-2, ZeRO-3, HSDP, tp 2, pp 2, cp 2, offload): the
  losses equal one process's within 1e-5, each run's record (run_dir/active)
  showing Muon's state was built and its matrix exchange ran, on the plan asked for.
- Resume under another plan, ZeRO-3 dp 4 -> tp 2 -> one process, the momentum
  compared after each resume against an uninterrupted run's.
- Bad input: exit 2 naming the key.
"""
import json
import pathlib
import subprocess

import numpy as np
import pytest

from conftest import (CONFIGS, SOURCE, active_records, nnstrain_bin_path, read_metrics, run_ranks,
                      single_process_env, train_window_starts, write_token_file)

SEED, SEQ, BATCH, STEPS = 1337, 16, 4, 20
TOL = 1e-5


def batch(tokens, step):
    """The trainer's batch of data step `step` (data/token_bin.cpp window_start)."""
    import torch
    starts = train_window_starts(len(tokens), SEED, step, BATCH, SEQ)
    rows = np.stack([tokens[s:s + SEQ + 1].astype(np.int64) for s in starts])
    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())


@pytest.fixture(scope="module")
def tokens_path(tmp_path_factory):
    return write_token_file(tmp_path_factory.mktemp("muon_data") / "tokens.bin", n_tokens=8000)


MODELS = {
    # GPT-2's Conv1D stores [in, out]: match_rms_adamw's adjustment is symmetric in the
    # two sides, and Newton-Schulz runs on the short side first, so either layout computes the same.
    "gpt": dict(adjust="match_rms_adamw",
                args={"vocab_size": 64, "block_size": SEQ, "n_layer": 2, "n_head": 3, "n_embd": 48,
                      "dropout": 0.0, "bias": True}),
    # Llama's Linear stores [out, in] as nnstrain does: PyTorch's original adjustment, sqrt(max(1, A/B)).
    "llama": dict(adjust="original",
                  args={"vocab_size": 64, "hidden_size": 40, "intermediate_size": 72, "num_hidden_layers": 2,
                        "num_attention_heads": 5, "num_key_value_heads": 1, "max_position_embeddings": SEQ,
                        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}),
}
MUON = {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 0.05, "ns_steps": 5}
ADAMW = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def hf_model(kind, folder):
    import torch
    import transformers
    torch.manual_seed(5)
    if kind == "gpt":
        a = MODELS["gpt"]["args"]
        cfg = transformers.GPT2Config(vocab_size=a["vocab_size"], n_positions=SEQ, n_embd=a["n_embd"],
                                      n_layer=a["n_layer"], n_head=a["n_head"], activation_function="gelu",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                                      tie_word_embeddings=True, attn_implementation="eager",
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        a = MODELS["llama"]["args"]
        cfg = transformers.LlamaConfig(vocab_size=a["vocab_size"], hidden_size=a["hidden_size"],
                                       intermediate_size=a["intermediate_size"],
                                       num_hidden_layers=a["num_hidden_layers"],
                                       num_attention_heads=a["num_attention_heads"],
                                       num_key_value_heads=a["num_key_value_heads"], max_position_embeddings=SEQ,
                                       rope_theta=a["rope_theta"], rms_norm_eps=1e-5, tie_word_embeddings=False,
                                       attn_implementation="eager", bos_token_id=None, eos_token_id=None,
                                       pad_token_id=None)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger than the default init, so 20 steps move every weight visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.float().save_pretrained(folder)
    return model


def write_config(path, kind, tokens, init_from):
    import yaml
    m = MODELS[kind]
    cfg = {
        "run_dir": str(path.parent / "run"), "pas_policy": "dp",
        "compute_config": {"device": "cpu", "backend": "gloo"},
        "model": {"type": kind, "init_from": str(init_from), "args": m["args"]},
        "optimizer": {"type": "muon", "args": {**MUON, "adjust_lr_fn": m["adjust"]},
                      "adamw_args": {**ADAMW, "impl": "loop"}},
        "lr_scheduler": {"type": "constant"},
        "dataset": {"type": "token_bin", "train_args": {"path": str(tokens), "dtype": "uint16", "seq_len": SEQ}},
        "micro_batch_size": BATCH, "max_train_steps": STEPS, "log_progress_every_n_train_steps": 1,
        "seed": SEED, "precision": "32-true",
        "checkpoint": {"save_dir": str(path.parent / "ckpt"), "every_n_train_steps": 0},
    }
    path.write_text(yaml.safe_dump(cfg))


def torch_reference(model, tokens, adjust):
    """The same 20 steps with torch.optim.Muon (matrices inside the blocks) and torch.optim.AdamW (the rest,
    weight decay on tensors of two or more dims, nanoGPT's groups)."""
    import torch
    import torch.nn.functional as F
    from torch.optim import _muon

    inner = [n for n, p in model.named_parameters() if p.dim() == 2 and (".h." in n or ".layers." in n)]
    assert len(inner) >= 8, inner
    params = dict(model.named_parameters())
    muon = torch.optim.Muon([params[n] for n in inner], **MUON, adjust_lr_fn=adjust)
    rest = [(n, p) for n, p in params.items() if n not in inner]
    adamw = torch.optim.AdamW([{"params": [p for n, p in rest if p.dim() >= 2], "weight_decay": ADAMW["weight_decay"]},
                               {"params": [p for n, p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"], foreach=False)
    ns = _muon._zeropower_via_newtonschulz

    def ns_fp32(grad, *args):  # PyTorch's iteration as written, without its cast to bf16
        cast = torch.Tensor.bfloat16
        torch.Tensor.bfloat16 = lambda t: t.clone()
        try:
            return ns(grad, *args)
        finally:
            torch.Tensor.bfloat16 = cast

    _muon._zeropower_via_newtonschulz = ns_fp32
    losses = []
    try:
        model.train()
        for step in range(STEPS):
            x, y = batch(tokens, step)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            losses.append(loss.item())
            muon.zero_grad(set_to_none=True)
            adamw.zero_grad(set_to_none=True)
            loss.backward()
            muon.step()
            adamw.step()
    finally:
        _muon._zeropower_via_newtonschulz = ns
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_matches_torch_optim_muon(kind, tokens_path, tmp_path):
    import torch
    from safetensors.torch import load_file
    model = hf_model(kind, tmp_path / "hf")
    write_config(tmp_path / "cfg.yaml", kind, tokens_path, tmp_path / "hf")
    p = subprocess.run([nnstrain_bin_path(), "--config", str(tmp_path / "cfg.yaml")], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (rec,) = active_records(tmp_path / "run", 1).values()
    state = rec["optimizer"]["state_segments"]  # what was built: Muon's momentum for the 4 (GPT) / 7 (Llama) block matrices
    assert state.get("momentum_buffer") == (8 if kind == "gpt" else 14) and state.get("exp_avg"), rec["optimizer"]
    assert rec["optimizer"]["impl"].startswith("muon (") and "Newton-Schulz in fp32" in rec["optimizer"]["impl"]
    train, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    ours = [r["loss"] for r in sorted(train, key=lambda r: r["step"])]
    for r in train:  # both optimizers' rates logged: AdamW's as lr, Muon's at the same schedule factor
        assert r["lr_muon"] == pytest.approx(r["lr"] * MUON["lr"] / ADAMW["lr"], rel=1e-12), r

    tokens = np.fromfile(tokens_path, dtype="<u2")
    ref_losses, ref_weights = torch_reference(model, tokens, MODELS[kind]["adjust"])
    assert len(ours) == STEPS
    assert ref_losses[-1] < ref_losses[0] - 0.05, ref_losses  # the comparison is of a run that learned
    assert rel(ours, ref_losses) < TOL, list(zip(ours, ref_losses))

    m = subprocess.run([nnstrain_bin_path(), "merge", str(tmp_path / "ckpt"), "--out", str(tmp_path / "merged"),
                        "--hf"], cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stdout + m.stderr
    got = {}
    for f in sorted((tmp_path / "merged").glob("*.safetensors")):
        got.update(load_file(f))
    compared = 0
    for name, want in ref_weights.items():
        if name not in got:
            continue  # tied lm_head / non-persistent buffers
        have = got[name]
        assert have.shape == want.shape, name
        if name.endswith("attn.c_attn.bias"):
            # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift common
            # to all keys), so AdamW's normalised update there is rounding noise: left out.
            c = MODELS["gpt"]["args"]["n_embd"]
            have, want = torch.cat([have[:c], have[2 * c:]]), torch.cat([want[:c], want[2 * c:]])
        assert rel(have, want) < TOL, f"{name}: relative difference {rel(have, want):.2e}"
        compared += 1
    assert compared >= len([n for n, _ in model.named_parameters()]) - 1, sorted(got)


# --- Under other plans, and resumed under others: tests/integration/configs/tiny_gpt_muon.yaml ---

PLAN_STEPS = 6
PLANS = {  # name: (ranks, overrides); global batch 4 everywhere
    "dp2": (2, ["--micro_batch_size", "2"]),  # replicas: each matrix's piece sent by one holder, the update to both
    "zero1_dp2": (2, ["--micro_batch_size", "2", "--compute_config.use_zero", "1"]),
    "zero2_dp2": (2, ["--micro_batch_size", "2", "--compute_config.use_zero", "2"]),
    "hsdp_dp4": (4, ["--micro_batch_size", "1", "--compute_config.use_zero", "1", "--compute_config.zero_ngroups", "2"]),
    "pp2": (2, ["--micro_batch_size", "1", "--compute_config.pas_config.pp_size", "2"]),
    "cp2": (2, ["--micro_batch_size", "4", "--compute_config.context_parallel_size", "2"]),
    # Half the optimizer's buckets (their momentum with them) stepped on the host, bucket by bucket.
    "offload_zero1_dp2": (2, ["--micro_batch_size", "2", "--compute_config.use_zero", "1",
                              "--compute_config.offload.optimizer", "true", "--compute_config.offload.ratio", "0.5",
                              "--compute_config.reducer_bucket_cap_mb", "0.02"]),
}


def train(ranks, run_dir, tokens, *overrides, steps, resume=None, save_dir=None):
    args = ["--config", str(CONFIGS / "tiny_gpt_muon.yaml"), "--vars.data", str(tokens), "--run_dir", str(run_dir),
            "--global_batch_size", "4", "--max_train_steps", str(steps), "--val_every_n_train_steps", "0",
            "--lr_scheduler.args.decay_steps", "12", *overrides]
    if save_dir:
        args += ["--checkpoint.save_dir", str(save_dir), "--checkpoint.every_n_train_steps", "4"]
    if resume:
        args += ["--resume", str(resume)]
    got = run_ranks(ranks, run_dir, args, list(overrides))  # asserts the plan asked for ran
    for rank, rec in active_records(run_dir, ranks).items():  # and that Muon was the optimizer that ran
        assert rec["optimizer"]["impl"].startswith("muon (") and rec["optimizer"]["state_segments"]["momentum_buffer"], \
            f"rank {rank}: {rec['optimizer']}"
        # Where a pipeline stage spans ranks, each matrix was gathered to its owner and scattered back.
        exchanges = 2 if rec["groups"]["stage"]["size"] > 1 else 0
        assert rec["groups"]["stage"]["size"] * rec["groups"]["pp"]["size"] == ranks, rec["groups"]
        assert rec["first_step"]["optimizer_all_to_all"] == exchanges, f"rank {rank}: {rec['first_step']}"
    return got


@pytest.fixture(scope="module")
def reference(tokens_path, tmp_path_factory):
    """One process, 12 steps, checkpoints at 4, 8 and 12."""
    d = tmp_path_factory.mktemp("muon_one")
    return train(1, d / "run", tokens_path, "--micro_batch_size", "4", steps=12, save_dir=d / "ckpt"), d / "ckpt"


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_plan_equals_one_process(plan, reference, tokens_path, tmp_path):
    ranks, overrides = PLANS[plan]
    got = train(ranks, tmp_path / "run", tokens_path, *overrides, steps=PLAN_STEPS)
    if "offload" in plan:  # some of Muon's matrices had their momentum on the host
        for rank, rec in active_records(tmp_path / "run", ranks).items():
            assert 0 < rec["offload"]["host_buckets"] < rec["offload"]["buckets"], f"rank {rank}: {rec['offload']}"
    want = reference[0]
    for step in range(1, PLAN_STEPS + 1):
        assert got[step][0] == pytest.approx(want[step][0], rel=TOL), f"{plan} step {step}: {got[step]} vs {want[step]}"


def test_experts_under_expert_parallelism_equal_one_process(tokens_path, tmp_path):
    """Qwen3-MoE's experts (one matrix each to Muon) at ep 2 x ZeRO-3 over 4 ranks, and at one process."""
    def run(ranks, name, *overrides):
        args = ["--config", str(CONFIGS / "tiny_moe_muon.yaml"), "--vars.data", str(tokens_path), "--run_dir",
                str(tmp_path / name), "--global_batch_size", "4", "--max_train_steps", "4", "--val_every_n_train_steps",
                "0", *overrides]
        got = run_ranks(ranks, tmp_path / name, args, list(overrides))
        return got, active_records(tmp_path / name, ranks)
    one, _ = run(1, "one", "--micro_batch_size", "4")
    ep, records = run(4, "ep", "--micro_batch_size", "1", "--compute_config.expert_parallel_size", "2",
                      "--compute_config.use_zero", "3")
    for rank, rec in records.items():
        assert rec["optimizer"]["impl"].startswith("muon (") and rec["first_step"]["optimizer_all_to_all"] == 2, rec
    for step in one:
        assert ep[step][0] == pytest.approx(one[step][0], rel=TOL), f"step {step}: {ep[step]} vs {one[step]}"


def test_offloaded_matrices_keep_one_moment_on_the_host(tokens_path, tmp_path):
    """The whole optimizer on the host: Muon's matrices keep their momentum there and no second
    moment; the planner's host figure is what the run held."""
    import re
    run_dir = tmp_path / "run"
    p = subprocess.run([nnstrain_bin_path(), "--config", str(CONFIGS / "tiny_gpt_muon.yaml"), "--vars.data",
                        str(tokens_path), "--run_dir", str(run_dir), "--max_train_steps", "2",
                        "--val_every_n_train_steps", "0", "--compute_config.offload.optimizer", "true",
                        "--compute_config.offload.ratio", "1.0"],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert active_records(run_dir, 1)[0]["optimizer"]["impl"].startswith("muon (")
    log = p.stdout + p.stderr
    h = re.search(r"held on the host between steps \(offload\): weights (\d+), gradients (\d+), "
                  r"optimizer moments (\d+), parameters and staging (\d+) bytes", log)
    assert h, log
    weights, grads, moments, staging = map(int, h.groups())
    # fp32 throughout: the weights' bytes count every offloaded element; the matrices
    # Muon takes are the four of each block (c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj).
    c, layers = 32, 2
    matrices = layers * (3 * c * c + c * c + 4 * c * c + 4 * c * c)
    assert weights > 4 * matrices and moments == 2 * weights - 4 * matrices, (weights, moments, matrices)
    est = json.loads((run_dir / "plan.json").read_text())["estimate"]
    assert est["host_bytes"] == pytest.approx(weights + grads + moments + staging, rel=1e-9), (est, h.groups())


def momentum(ckpt_dir, step, tmp_path):
    """Muon's momentum_buffer/* of checkpoint `step`, merged whole (nnstrain merge)."""
    from safetensors.numpy import load_file
    out = tmp_path / f"merged_{ckpt_dir.parent.name}_{step}"
    m = subprocess.run([nnstrain_bin_path(), "merge", str(ckpt_dir / f"step-{step:08d}"), "--out", str(out)],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    assert m.returncode == 0, m.stdout + m.stderr
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update({k: v for k, v in load_file(f).items() if k.startswith("momentum_buffer/")})
    assert len(tensors) == 8, sorted(tensors)
    return tensors


def test_resume_zero3_dp4_then_tp2_then_one_process(reference, tokens_path, tmp_path):
    want, ref_ckpt = reference
    ckpt = tmp_path / "ckpt"
    got = train(4, tmp_path / "a", tokens_path, "--micro_batch_size", "1", "--compute_config.use_zero", "3",
                steps=4, save_dir=ckpt)
    got.update(train(2, tmp_path / "b", tokens_path, "--micro_batch_size", "4", "--pas_policy", "tp",
                     "--compute_config.plan_ngpus", "2", steps=8, save_dir=ckpt, resume=ckpt / "step-00000004"))
    got.update(train(1, tmp_path / "c", tokens_path, "--micro_batch_size", "4", steps=12, save_dir=ckpt,
                     resume=ckpt / "step-00000008"))
    for step in range(1, 13):
        assert got[step][0] == pytest.approx(want[step][0], rel=1e-6), f"step {step}: {got[step]} vs {want[step]}"
    # The momentum each resume started from (steps 4 and 8) is the uninterrupted run's, up to the
    # rounding of another order of sums (tp 2's partial products): within 1e-6 in norm. At the end
    # (step 12), 4 steps later, within 1e-5: Newton-Schulz maps every singular direction of the
    # momentum to about one, so it amplifies rounding in the small ones (measured 1.1e-6; AdamW's
    # moments over the same chain differ by 2.5e-7).
    for step, tol in ((4, 1e-6), (8, 1e-6), (12, 1e-5)):
        mine, ref = momentum(ckpt, step, tmp_path), momentum(ref_ckpt, step, tmp_path)
        assert sorted(mine) == sorted(ref)
        for k in ref:
            assert np.abs(ref[k]).max() > 0, k
            diff = float(np.linalg.norm(mine[k] - ref[k]) / np.linalg.norm(ref[k]))
            assert diff < tol, f"step {step} {k}: relative difference {diff:.2e} in norm"


@pytest.mark.parametrize("override, key", [
    (["--optimizer.args.ns_steps", "-1"], "optimizer.args.ns_steps"),
    (["--optimizer.args.params", "[\"*ln_*\"]"], "optimizer.args.params"),
    (["--optimizer.args.params", "[\"nothing.here\"]"], "optimizer.args.params"),
    (["--optimizer.args.betas", "[0.9, 0.95]"], "optimizer.args.betas"),
    (["--optimizer.args.adjust_lr_fn", "sqrt"], "optimizer.args.adjust_lr_fn"),
])
def test_bad_input_names_the_key(override, key, tokens_path, tmp_path):
    p = subprocess.run([nnstrain_bin_path(), "--config", str(CONFIGS / "tiny_gpt_muon.yaml"), "--vars.data",
                        str(tokens_path), "--run_dir", str(tmp_path / "run"), "--max_train_steps", "2", *override],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert key in out and "Traceback" not in out and "terminate called" not in out, out
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_resuming_another_optimizers_state_is_refused(tokens_path, tmp_path):
    common = ["--vars.data", str(tokens_path), "--max_train_steps", "2", "--val_every_n_train_steps", "0",
              "--checkpoint.save_dir", str(tmp_path / "ckpt")]
    p = subprocess.run([nnstrain_bin_path(), "--config", str(CONFIGS / "tiny_gpt.yaml"), "--run_dir",
                        str(tmp_path / "adamw"), *common], cwd=SOURCE, env=single_process_env(1), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    p = subprocess.run([nnstrain_bin_path(), "--config", str(CONFIGS / "tiny_gpt_muon.yaml"), "--run_dir",
                        str(tmp_path / "muon"), *common, "--max_train_steps", "4", "--resume",
                        str(tmp_path / "ckpt" / "step-00000002")],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "optimizer.type: muon" in out and "state of adamw" in out, out
