"""ZeRO-2, ZeRO-3 and HSDP under pipeline parallelism (issue 21): parity with one
process on CPU/Gloo, fp32, 10 steps, clipping active, the same global batch
(test_pipeline's runs and reference), ZeRO-3's gathers counted at the
collectives (once per unit per step, not per micro-batch), and a pp2 x ZeRO-3
checkpoint resumed by one process and merged.
"""
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import assert_active, device_args, nnstrain_bin_path, rank_log_numbers, run_ranks, single_process_env
from test_pipeline import CONFIG, LAYERS, STEPS, TOL, compare, model_args, reference, run  # noqa: F401 (a fixture)


def micros(dp):
    """Micro-batches per step: global batch 8 = micro-batch 2 x nmicros x dp."""
    return 8 // (2 * dp)


def zero_traffic(run_dir, ranks):
    """{rank: (all-gathers, reduce-scatters, buckets)} of the ZeRO group by the end of the run, from each rank's log."""
    return rank_log_numbers(run_dir, ranks, rf"ZeRO group collectives by the end of step {STEPS}: (\d+) all-gathers, "
                                            r"(\d+) reduce-scatters, \d+ all-reduces over (\d+) buckets")


def units_of(model, stage, stages):
    """ZeRO-3 units a stage of the 8-layer tiny models holds under pp: a unit per block, the
    parameters before the blocks (GPT's position embedding, Llama's token embedding), those after
    (the final norm; Llama's untied head with it), and GPT's tied token embedding, held by the
    first and the last stage, a unit of its own."""
    n = LAYERS // stages
    if model == "gpt":
        return n + (stage in (0, stages - 1)) + (stage == 0) + (stage == stages - 1)
    return n + (stage == 0) + (stage == stages - 1)


@pytest.mark.parametrize("model", ("gpt", "llama"))
@pytest.mark.parametrize("zero", (2, 3))
def test_zero_under_pp2_dp2(reference, tmp_path, tiny_tokens, model, zero):
    """pp2 x dp2, 1F1B: each stage's gradients reduce-scattered over its own dp group per
    micro-batch's backward, GPT's tied embedding summed in the shard. ZeRO-3 gathers each unit
    once per step: the all-gathers counted on every rank's ZeRO group are its units x steps
    (gathered per micro-batch, for its forward and again its backward, they would be 2 x nmicros
    times that); the reduce-scatters are buckets x nmicros x steps (one per micro-batch's backward)."""
    ov = ["--compute_config.pas_config.pp_size", "2", "--compute_config.use_zero", str(zero)]
    got, out = run(4, tmp_path, tiny_tokens, model, *ov)
    assert_active(tmp_path, out, 4, ov)  # the shards held, gradient traffic
    compare(reference(model), got, f"{model} pp2 x dp2 ZeRO-{zero}")
    traffic = zero_traffic(tmp_path, 4)
    for rank, (gathers, scatters, buckets) in traffic.items():
        stage = rank % 2  # ranks laid out [TP, CP, PP, DP]: rank = dp x 2 + pipeline rank
        if zero == 3:
            assert buckets == units_of(model, stage, 2), (rank, buckets)
            assert gathers == STEPS * buckets, f"rank {rank}: {gathers} all-gathers, {buckets} units, {STEPS} steps"
        else:  # ZeRO-2: the updated chunks gathered after each step
            assert gathers == STEPS * buckets, (rank, gathers, buckets)
        assert scatters == STEPS * micros(2) * buckets, f"rank {rank}: {scatters} reduce-scatters of {buckets} buckets"


def test_zero3_zbv(reference, tmp_path, tiny_tokens):
    """ZeRO-3 under zbv: a split backward (I, then W whose weight gradients are reduce-scattered)
    and two stages per rank, the first and the last (the tied embedding's two uses) on rank 0."""
    ov = ["--compute_config.pas_config.pp_size", "2", "--compute_config.pas_config.pipeline_scheduler", "zbv",
          "--compute_config.use_zero", "3"]
    got, out = run(4, tmp_path, tiny_tokens, "gpt", *ov)
    assert_active(tmp_path, out, 4, ov)
    compare(reference("gpt"), got, "gpt pp2 zbv x dp2 ZeRO-3")
    for rank, (gathers, _, buckets) in zero_traffic(tmp_path, 4).items():
        assert gathers == STEPS * buckets, (rank, gathers, buckets)


def test_hsdp_under_pp2_dp4(reference, tmp_path, tiny_tokens):
    """pp2 x dp4, ZeRO-3 with zero_ngroups 2 (8 ranks): each stage shards over 2 ranks and
    all-reduces the shards across the two groups. The untied Llama, micro-batch 1 (2 per step)."""
    ov = ["--compute_config.pas_config.pp_size", "2", "--compute_config.use_zero", "3",
          "--compute_config.zero_ngroups", "2", "--micro_batch_size", "1"]
    got, out = run(8, tmp_path, tiny_tokens, "llama", *ov)
    assert_active(tmp_path, out, 8, ov)  # shards over 2 of the 4 dp ranks (parity needs the cross-group sum)
    compare(reference("llama"), got, "llama pp2 x dp4 HSDP (2 groups) ZeRO-3")


def test_zero3_checkpoint_resumes_under_one_process(tmp_path, tiny_tokens):
    """pp2 x ZeRO-3 dp2 saves at step 4 (each piece a ZeRO chunk of one stage's units, GPT's tied
    embedding on two ranks); one process resumes it and continues the uninterrupted one-process run,
    and `nnstrain merge` of the pipeline checkpoint gives that run's step-4 weights."""
    def args(name, ranks, *extra):
        return ["--config", str(CONFIG), "--run_dir", str(tmp_path / name), "--vars.data", str(tiny_tokens),
                "--micro_batch_size", "2", "--global_batch_size", "8", *device_args(ranks), *model_args("gpt"),
                "--checkpoint.every_n_train_steps", "4", "--checkpoint.save_dir", str(tmp_path / name / "ckpt"),
                *map(str, extra)]
    ten = ["--max_train_steps", str(STEPS)]
    pp = ["--compute_config.pas_config.pp_size", "2", "--compute_config.use_zero", "3"]
    ref = run_ranks(1, tmp_path / "one", args("one", 1, *ten), [])
    run_ranks(4, tmp_path / "pp", args("pp", 4, "--max_train_steps", "4", *pp), pp)
    step4 = tmp_path / "pp" / "ckpt" / "step-00000004"
    back = run_ranks(1, tmp_path / "back", args("back", 1, *ten, "--resume", step4), [])
    assert sorted(back) == list(range(5, STEPS + 1)), back
    compare({s: ref[s] for s in back}, back, "pp2 x ZeRO-3 dp2's step 4 resumed by one process")
    merged = {}
    for name, ckpt in (("pp", step4), ("one", tmp_path / "one" / "ckpt" / "step-00000004")):
        out = tmp_path / f"merged_{name}"
        p = subprocess.run([nnstrain_bin_path(), "merge", str(ckpt), "--out", str(out)], capture_output=True,
                           text=True, env=single_process_env(1))
        assert p.returncode == 0, p.stdout + p.stderr
        merged[name] = load_file(str(out / "model.safetensors"))
    assert sorted(merged["pp"]) == sorted(merged["one"])

    def comparable(name, t):
        # GPT's key bias adds the same q.b to every score of a query's row, which softmax ignores: its
        # gradient is rounding noise, which AdamW turns into updates of the learning rate's size.
        return np.concatenate([t[:32], t[64:]]) if name.endswith("attn.c_attn.bias") else t
    worst = max(float(np.abs(comparable(k, merged["pp"][k]) - comparable(k, v)).max() / max(np.abs(v).max(), 1e-12))
                for k, v in merged["one"].items())
    print(f"merge of the pp2 x ZeRO-3 checkpoint at step 4: largest relative weight difference {worst:.2e}")
    assert worst < TOL
