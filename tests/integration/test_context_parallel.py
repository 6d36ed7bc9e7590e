"""Context parallelism end to end (issue 22): each sequence split over the cp ranks,
attention by the ring (or all-gather) op, gradients reduced over dp x cp, the
loss the token-weighted mean over every rank and micro-batch.

fp32 on CPU/Gloo, 10 steps with clipping active, the same global batch of 4
sequences of 32 tokens, against one process, for the GPT of configs/tiny_dp.yaml
(4 heads, learned positions) and the Llama of configs/tiny_llama.yaml (GQA,
rotary): cp2, cp4, cp2 x tp2 with sequence parallelism, cp2 x ZeRO-3 dp2 within
1e-5 relative in loss and gradient norm (and cp2's validation loss within
1e-5); bf16-mixed cp2 within the precision tests' bf16 tolerance; cp2 composed
with recompute and the fused loss, the chunked loss, HSDP (ZeRO-3, cp2 x dp4 in
2 groups), 16-mixed and bf16-true, each against one process with the same
setting (16-true, its loss scaler skipping the same steps as one process:
test_fp16_replicas.py). Checkpoints hold no cp state: saved at cp2 (GPT) or cp4
(Llama) and resumed at cp1, and the reverse, each continuing the uninterrupted
one-process run. A rank killed inside a ring step ends every other rank within
the collective timeout, naming the collective.
"""
import json
import re

import pytest

from conftest import CONFIGS, active_records, device_args, loss_ran, read_metrics, run_ranks
from test_collective_failure import Ranks, killed_in_ring
from test_precision import BF16_RTOL

TOL = 1e-5
CLIP = 0.95  # the configs' optimizer.clip_gnorm
MODELS = {"gpt": ("tiny_dp.yaml", ["--model.args.n_head", "4"]), "llama": ("tiny_llama.yaml", [])}


def run(model, ranks, run_dir, data, *overrides, resume=None, save_dir=None):
    """nnstrain on `ranks` processes; returns {step: (loss, grad_norm)}."""
    config, model_args = MODELS[model]
    args = ["--config", str(CONFIGS / config), "--run_dir", str(run_dir), "--vars.data", str(data),
            "--global_batch_size", "4", *model_args, *device_args(ranks), *map(str, overrides)]
    if save_dir:
        args += ["--checkpoint.save_dir", str(save_dir), "--checkpoint.every_n_train_steps", "5"]
    if resume:
        args += ["--resume", str(resume)]
    return run_ranks(ranks, run_dir, args, overrides)  # asserts cp (and tp, ZeRO) really ran


CP = "--compute_config.context_parallel_size"
PLANS = {  # name: (ranks, overrides)
    "one": (1, ["--micro_batch_size", "4"]),
    "cp2": (2, ["--micro_batch_size", "4", CP, "2"]),
    "cp4": (4, ["--micro_batch_size", "4", CP, "4"]),
    "cp2_tp2_sp": (4, ["--micro_batch_size", "4", CP, "2", "--compute_config.plan_ngpus", "2",
                       "--pas_policy", "hybrid", "--compute_config.sequence_parallel", "true"]),
    "cp2_zero3_dp2": (4, ["--micro_batch_size", "2", CP, "2", "--compute_config.use_zero", "3"]),
    # The other comm type and layout, once each.
    "cp2_all_gather": (2, ["--micro_batch_size", "4", CP, "2", "--compute_config.cp_comm_type", "all_gather"]),
    "cp4_contiguous_accum": (4, ["--micro_batch_size", "2", CP, "4", "--compute_config.cp_load_balance", "none",
                                 "--grad_accumulation_steps", "2"]),
}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_tokens):
    """{(model, plan): ({step: (loss, grad norm)}, checkpoint dir)}, 10 uninterrupted steps each, saved at 5 and 10."""
    cache = {}

    def get(model, plan):
        if (model, plan) not in cache:
            ranks, ov = PLANS[plan]
            d = tmp_path_factory.mktemp(f"{model}_{plan}")
            cache[model, plan] = (run(model, ranks, d / "run", tiny_tokens, *ov, save_dir=d / "ckpt"), d / "ckpt")
        return cache[model, plan]
    return get


def saved_tensors(step_dir):
    """{name: global shape} of every tensor a checkpoint holds, per-rank RNG states left out."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    return {spec["name"]: spec["global_shape"] for specs in manifest["files"].values() for spec in specs
            if not spec["name"].startswith("rng/")}


def compare(ref, got, what):
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    worst_loss = max(rel(got[s][0], ref[s][0]) for s in got)
    worst_norm = max(rel(got[s][1], ref[s][1]) for s in got)
    print(f"\n{what}: largest relative loss difference {worst_loss:.2e}, grad norm {worst_norm:.2e}")
    return worst_loss, worst_norm


@pytest.mark.parametrize("model,plan", [("gpt", "cp2"), ("gpt", "cp4"), ("gpt", "cp2_tp2_sp"), ("gpt", "cp2_zero3_dp2"),
                                        ("gpt", "cp4_contiguous_accum"), ("llama", "cp2"), ("llama", "cp4"),
                                        ("llama", "cp2_tp2_sp"), ("llama", "cp2_zero3_dp2"),
                                        ("llama", "cp2_all_gather")])
def test_parity_with_one_process(straight, model, plan):
    ref, _ = straight(model, "one")
    got, _ = straight(model, plan)
    assert sorted(got) == list(range(1, 11))
    worst_loss, worst_norm = compare(ref, got, f"{model} {plan} vs one process")
    assert worst_loss < TOL and worst_norm < TOL
    # Meaningful: training moved the loss, and clipping decided some updates.
    assert ref[10][0] < ref[1][0] - 0.1, ref
    assert any(ref[s][1] > CLIP for s in ref), ref


# Composition (the list): each against one process with the same shared
# overrides. HSDP: cp2 x dp4, ZeRO-3 in 2 groups of dp x cp / 2 = 4 ranks.
COMPOSED = {  # name: (ranks, cp overrides, overrides both sides share, tolerance)
    "recompute_fused": (2, ["--micro_batch_size", "4", CP, "2"],
                        ["--model.activation_checkpointing", "true", "--model.loss", "fused", "--model.loss_chunk_size", "24"],
                        TOL),
    "chunked": (2, ["--micro_batch_size", "4", CP, "2"], ["--model.loss", "chunked", "--model.loss_chunk_size", "24"], TOL),
    "hsdp_zero3": (8, ["--micro_batch_size", "1", CP, "2", "--compute_config.use_zero", "3",
                       "--compute_config.zero_ngroups", "2"], [], TOL),
    "fp16_mixed": (2, ["--micro_batch_size", "4", CP, "2"], ["--precision", "16-mixed"], BF16_RTOL),
    "bf16_true": (2, ["--micro_batch_size", "4", CP, "2"], ["--precision", "bf16-true"], BF16_RTOL),
}


@pytest.mark.parametrize("model,name", [("llama", "recompute_fused"), ("gpt", "chunked"), ("llama", "hsdp_zero3"),
                                        ("gpt", "fp16_mixed"), ("llama", "bf16_true")])
def test_composition(tmp_path, tiny_tokens, model, name):
    ranks, ov, shared, tol = COMPOSED[name]
    ref = run(model, 1, tmp_path / "one", tiny_tokens, *PLANS["one"][1], *shared)
    got = run(model, ranks, tmp_path / name, tiny_tokens, *ov, *shared)
    if "--model.loss" in shared:  # both sides ran that loss's forward on each micro-batch (their records)
        kind = shared[shared.index("--model.loss") + 1]
        assert loss_ran(active_records(tmp_path / name, ranks), kind) == ranks
        loss_ran(active_records(tmp_path / "one", 1), kind)
    worst_loss, worst_norm = compare(ref, got, f"{model} cp2 {name} vs one process")
    assert worst_loss < tol and worst_norm < (tol if tol == TOL else 4 * tol)  # 16-bit: test_precision's rule
    assert ref[10][0] < ref[1][0] - 0.1 and any(ref[s][1] > CLIP for s in ref), ref


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_bf16_mixed_cp2_equals_one_process(tmp_path, tiny_tokens, model):
    bf16 = ["--precision", "bf16-mixed"]
    ref = run(model, 1, tmp_path / "one", tiny_tokens, *PLANS["one"][1], *bf16)
    got = run(model, 2, tmp_path / "cp2", tiny_tokens, *PLANS["cp2"][1], *bf16)
    worst_loss, worst_norm = compare(ref, got, f"{model} bf16-mixed cp2 vs one process")
    assert worst_loss <= BF16_RTOL and worst_norm <= 4 * BF16_RTOL  # test_precision.py's tolerances
    # Meaningful: bf16 is not fp32 (it differs from it beyond the fp32 parity tolerance).
    fp32 = run(model, 1, tmp_path / "fp32", tiny_tokens, *PLANS["one"][1])
    assert max(rel(ref[s][0], fp32[s][0]) for s in ref) > TOL


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_validation_loss_under_cp_equals_one_process(tmp_path, tiny_tokens, model):
    """Validation batches are cut over the cp ranks as training's are: the token-weighted
    val_loss (at steps 5 and 10, 2 batches each) equals one process's."""
    val = ["--dataset.val_args.path", tiny_tokens, "--val_every_n_train_steps", 5, "--max_val_steps", 2]
    got = {}
    for plan in ("one", "cp2"):
        ranks, ov = PLANS[plan]
        run(model, ranks, tmp_path / plan, tiny_tokens, *ov, *val)
        got[plan] = {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / plan / "metrics.jsonl")[1]}
    assert sorted(got["one"]) == [5, 10], got
    worst = max(rel(got["cp2"][s], got["one"][s]) for s in got["one"])
    print(f"\n{model} cp2 val loss vs one process: largest relative difference {worst:.2e}")
    assert worst < TOL and got["one"][10] < got["one"][5]


@pytest.mark.parametrize("model,src,dst", [("gpt", "cp2", "one"), ("gpt", "one", "cp2"),
                                           ("llama", "cp4", "one"), ("llama", "one", "cp4")])
def test_resume_across_cp_degrees(straight, tmp_path, tiny_tokens, model, src, dst):
    """A checkpoint of step 5 under `src` resumes under `dst` and continues the uninterrupted run."""
    ref, one_ckpt = straight(model, "one")
    _, ckpt = straight(model, src)
    # No cp state: the same tensors (per-rank RNG streams aside) as one process saves.
    assert saved_tensors(ckpt / "step-00000005") == saved_tensors(one_ckpt / "step-00000005")
    ranks, ov = PLANS[dst]
    got = run(model, ranks, tmp_path / "run", tiny_tokens, *ov, resume=ckpt / "step-00000005")
    assert sorted(got) == list(range(6, 11))
    worst_loss, worst_norm = compare({s: ref[s] for s in got}, got, f"{model} {src} -> {dst} after resume")
    assert worst_loss < TOL and worst_norm < TOL


def test_rank_killed_inside_a_ring_step_ends_every_rank(nnstrain_bin, tiny_tokens, tmp_path):
    """cp2 x dp2 (GPT): rank 1 SIGKILLs itself as it enters a ring step of its third
    or so training step; its cp peer (rank 0) fails in that ring step, the other
    cp group (ranks 2, 3) in the next collective they share with it. Each exits
    non-zero within the collective timeout plus a margin, naming the collective."""
    extra = [CP, "2", "--model.args.n_head", "4", "--micro_batch_size", "2", "--global_batch_size", "4",
             "--log_progress_every_n_train_steps", "1"]
    # GPT, 2 layers at cp2 p2p: a few ring steps per layer and pass, so the 30th falls a few steps in.
    with Ranks(nnstrain_bin, tiny_tokens, tmp_path, world=4, extra_args=extra,
               extra_env={"NNSTRAIN_TEST_KILL_IN_RING": "30:1"}) as job:
        out0 = killed_in_ring(job)[0]
        assert re.search(r"rank 0: collective 'context-parallel ring send/recv' .* on group cp0_0 \(ranks 0, 1\)",
                         out0), out0
        assert re.search(r"ranks not answering \(process gone or frozen\): 1\b", out0), out0
        steps = [r["step"] for r in read_metrics(job.run_dir / "metrics.jsonl")[0]]
        assert steps and max(steps) >= 1, "rank 1 died before training got going"
