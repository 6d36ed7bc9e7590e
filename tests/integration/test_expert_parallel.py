"""Expert parallelism end to end (issue 38): each MoE layer's experts split over ep
ranks carved out of dp x cp, tokens sent to their experts' ranks by all-to-all and
back, expert gradients reduced (and ZeRO-sharded) over the ranks holding the same
experts.

fp32 on CPU/Gloo, 10 steps with clipping active, the same global batch of 4
sequences of 32 tokens, the Qwen3-MoE of configs/tiny_moe_ep.yaml (12 experts, top-3)
against one process: ep 2 and ep 4 (dp = ep), ep 2 x tp 2 without and with sequence
parallelism (each tp rank routing its own tokens), tp 2 with sequence parallelism and a
gated shared expert, ep 2 x cp 2, ep 2 with
ZeRO-1 and ZeRO-2 over 4 ranks (experts sharded over the 2 ranks holding the same
ones), ep 2 with ZeRO-3 (a block's experts a unit bucket of their own), ep 2 x pp 2, ep 2
with ZeRO-1 and the optimizer offloaded, within 1e-5 relative in loss and gradient norm, and in the logged balancing loss and
imbalance (the MoE monitor's figures). Each run asserts from its
record of what ran (conftest.assert_active) that every rank held 1/ep of the expert
weights and that all-to-all traffic happened. Checkpoints: saved at ep 4, resumed
at ep 2, then at one process, each continuing the uninterrupted run. Under bf16-mixed, ep 2
within two bf16 ulps (7.8e-3; the precision tests allow dense models one) of one process. Bad input
(ep not dividing the experts or dp x cp, ep on a dense model) exits 2 naming the key.
"""
import subprocess

import pytest

from conftest import CONFIGS, SOURCE, active_records, device_args, nnstrain_bin_path, read_metrics, run_ranks, single_process_env

TOL = 1e-5
EP = "--compute_config.expert_parallel_size"
PLANS = {  # name: (ranks, overrides)
    "one": (1, ["--micro_batch_size", "4"]),
    "ep2": (2, ["--micro_batch_size", "2", EP, "2"]),
    "ep4": (4, ["--micro_batch_size", "1", EP, "4"]),
    "ep2_tp2": (4, ["--micro_batch_size", "2", EP, "2", "--compute_config.plan_ngpus", "2", "--pas_policy", "hybrid",
                    "--compute_config.sequence_parallel", "false"]),
    # Sequence parallelism: each tp rank routes its own half of the tokens.
    "ep2_tp2_sp": (4, ["--micro_batch_size", "2", EP, "2", "--compute_config.plan_ngpus", "2", "--pas_policy", "hybrid",
                       "--compute_config.sequence_parallel", "true"]),
    "ep2_cp2": (2, ["--micro_batch_size", "4", EP, "2", "--compute_config.context_parallel_size", "2"]),
    "ep2_zero1_dp4": (4, ["--micro_batch_size", "1", EP, "2", "--compute_config.use_zero", "1"]),
    "ep2_zero2_dp4": (4, ["--micro_batch_size", "1", EP, "2", "--compute_config.use_zero", "2"]),
    # HSDP: ZeRO within 2 groups of 2 ranks, each an ep slice; replicas all-reduced across them.
    "ep2_hsdp_zero1_dp4": (4, ["--micro_batch_size", "1", EP, "2", "--compute_config.use_zero", "1",
                               "--compute_config.zero_ngroups", "2"]),
    # ... and dp 4 x cp 2 in 2 ZeRO groups of 4: each shards an ep slice's experts over the 2 holding them.
    "ep2_cp2_hsdp_zero3_dp4": (8, ["--micro_batch_size", "1", EP, "2", "--compute_config.use_zero", "3",
                                   "--compute_config.zero_ngroups", "2", "--compute_config.context_parallel_size", "2"]),
    "ep2_zero3_dp2": (2, ["--micro_batch_size", "2", EP, "2", "--compute_config.use_zero", "3"]),
    "ep2_pp2": (4, ["--micro_batch_size", "1", EP, "2", "--compute_config.pas_config.pp_size", "2"]),
    # The whole optimizer (experts' buckets too) stepped on the host.
    "ep2_zero1_offload": (2, ["--micro_batch_size", "2", EP, "2", "--compute_config.use_zero", "1",
                              "--compute_config.offload.optimizer", "true"]),
}


def run(ranks, run_dir, data, *overrides, resume=None, save_dir=None, every=5):
    args = ["--config", str(CONFIGS / "tiny_moe_ep.yaml"), "--run_dir", str(run_dir), "--vars.data", str(data),
            "--global_batch_size", "4", *device_args(ranks), *map(str, overrides)]
    if save_dir:
        args += ["--checkpoint.save_dir", str(save_dir), "--checkpoint.every_n_train_steps", str(every)]
    if resume:
        args += ["--resume", str(resume)]
    return run_ranks(ranks, run_dir, args, overrides)  # asserts ep (and tp, cp, ZeRO) really ran


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def assert_close(got, want, what):
    assert sorted(got) == sorted(want), f"{what}: steps {sorted(got)} vs {sorted(want)}"
    for step in want:
        for i, name in enumerate(("loss", "grad_norm")):
            assert rel(got[step][i], want[step][i]) <= TOL, \
                f"{what}: step {step} {name} {got[step][i]!r} vs one process {want[step][i]!r}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_tokens):
    cache = {}

    def get(plan):
        if plan not in cache:
            ranks, ov = PLANS[plan]
            d = tmp_path_factory.mktemp(plan)
            cache[plan] = (run(ranks, d / "run", tiny_tokens, *ov, save_dir=d / "ckpt"), d / "ckpt")
            if "offload" in plan:  # the experts' optimizer state too was on the host
                for rank, rec in active_records(d / "run", ranks).items():
                    assert rec["offload"] and rec["offload"]["host_buckets"] == rec["offload"]["buckets"], \
                        f"{plan} rank {rank}: {rec['offload']}"
            train, _ = read_metrics(d / "run" / "metrics.jsonl")
            moe[plan] = {r["step"]: (r["moe_aux_loss"], r["moe_imbalance_max"]) for r in train}
        return cache[plan]
    moe = {}
    get.moe = moe
    return get


@pytest.mark.parametrize("plan", [p for p in PLANS if p != "one"])
def test_expert_parallel_equals_one_process(straight, plan):
    one, _ = straight("one")
    # The comparison is meaningful: the losses move and clipping is active (norm above 0.95).
    assert one[1][0] != one[10][0] and max(g for _, g in one.values()) > 0.95
    got, _ = straight(plan)
    assert_close(got, one, plan)
    # The MoE figures are the step's whatever the cut: the balancing loss (mean over sequences) and
    # the busiest expert's load over the mean (tokens summed over dp x cp), as one process logs them.
    want_moe, got_moe = straight.moe["one"], straight.moe[plan]
    assert sorted(got_moe) == sorted(want_moe)
    for step in want_moe:
        for i, name in enumerate(("moe_aux_loss", "moe_imbalance_max")):
            assert rel(got_moe[step][i], want_moe[step][i]) <= TOL, \
                f"{plan}: step {step} {name} {got_moe[step][i]!r} vs one process {want_moe[step][i]!r}"


def test_sequence_parallel_with_gated_shared_expert_equals_one_process(tmp_path, tiny_tokens):
    """tp 2 with sequence parallelism on a model with Qwen2-MoE's gated shared expert (tensor-parallel,
    its gate replicated on the sequence shards): each tp rank routes its own tokens; within 1e-5 of
    one process, balancing loss and imbalance included."""
    shared = ["--model.args.shared_expert_intermediate_size", "24"]
    one_dir, sp_dir = tmp_path / "one", tmp_path / "sp"
    one = run(1, one_dir, tiny_tokens, "--micro_batch_size", "4", *shared)
    sp = run(2, sp_dir, tiny_tokens, "--micro_batch_size", "4", "--compute_config.plan_ngpus", "2",
             "--pas_policy", "hybrid", "--compute_config.sequence_parallel", "true", *shared)
    assert one[1][0] != one[10][0] and max(g for _, g in one.values()) > 0.95  # it trains, clipping active
    assert_close(sp, one, "tp2 sp, shared expert")
    moe = [{r["step"]: (r["moe_aux_loss"], r["moe_imbalance_max"]) for r in read_metrics(d / "metrics.jsonl")[0]}
           for d in (one_dir, sp_dir)]
    for step in moe[0]:
        for i, name in enumerate(("moe_aux_loss", "moe_imbalance_max")):
            assert rel(moe[1][step][i], moe[0][step][i]) <= TOL, f"step {step} {name}: {moe[1][step]} vs {moe[0][step]}"


# Two bf16 ulps (2^-7), where the precision tests allow one (2^-8) for dense models: the
# bf16 hidden states feed the fp32 router, and a near-tie choosing another expert moves a
# token's whole output. Observed: up to 4.1e-3 over 10 steps (step 8), the others 1e-3 to 3e-3.
BF16_MOE_RTOL = 2 ** -7


def test_expert_parallel_under_bf16_mixed_equals_one_process(tmp_path, tiny_tokens):
    """bf16 compute, fp32 masters and routing: ep 2 within two bf16 ulps of one process."""
    bf16 = ["--precision", "bf16-mixed"]
    one = run(1, tmp_path / "one", tiny_tokens, "--micro_batch_size", "4", *bf16)
    ep = run(2, tmp_path / "ep2", tiny_tokens, "--micro_batch_size", "2", EP, "2", *bf16)
    assert sorted(ep) == sorted(one)
    for step in one:
        assert rel(ep[step][0], one[step][0]) <= BF16_MOE_RTOL, f"step {step}: loss {ep[step][0]} vs {one[step][0]}"


def test_resume_across_expert_parallel_degrees(straight, tmp_path, tiny_tokens):
    """Saved at ep 4 (step 5), resumed at ep 2 to step 10 (saving at 6 and 8), then that
    run's step-8 checkpoint resumed at one process: each continues the straight run."""
    one, _ = straight("one")
    _, ck4 = straight("ep4")
    ranks, ov = PLANS["ep2"]
    got = run(ranks, tmp_path / "r2", tiny_tokens, *ov, resume=ck4 / "step-00000005", save_dir=tmp_path / "ck2",
              every=2)
    assert_close(got, {s: v for s, v in one.items() if s > 5}, "ep4 -> ep2")
    ranks, ov = PLANS["one"]
    got = run(ranks, tmp_path / "r1", tiny_tokens, *ov, resume=tmp_path / "ck2" / "step-00000008")
    assert_close(got, {s: v for s, v in one.items() if s > 8}, "ep4 -> ep2 -> one process")


@pytest.mark.parametrize("config,ranks,overrides,message", [
    ("tiny_moe_ep.yaml", 2, [EP, "2", "--model.args.num_experts", "9"],
     "compute_config.expert_parallel_size 2 does not divide the 9 experts"),
    ("tiny_moe_ep.yaml", 3, [EP, "2", "--global_batch_size", "3", "--micro_batch_size", "1"],
     "compute_config.expert_parallel_size 2 does not divide dp x cp = 3 x 1"),
    ("tiny_llama.yaml", 2, [EP, "2", "--micro_batch_size", "2"], "has no experts"),
    ("tiny_moe_ep.yaml", 4, [EP, "4", "--micro_batch_size", "1", "--compute_config.use_zero", "1",
                             "--compute_config.zero_ngroups", "2"],
     "compute_config.expert_parallel_size 4 does not divide the ZeRO group of 2 ranks"),
])
def test_bad_expert_parallel_exits_2_naming_the_key(tmp_path, tiny_tokens, config, ranks, overrides, message):
    args = ["--config", str(CONFIGS / config), "--run_dir", str(tmp_path / "run"), "--vars.data",
            str(tiny_tokens), *device_args(ranks), *overrides]
    cmd = [nnstrain_bin_path(), "launch", "--nproc-per-node", str(ranks), "--", *args]
    p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2, f"exit {p.returncode}:\n{out}"
    assert message in out, out
    assert "Traceback" not in out and "terminate called" not in out, out
