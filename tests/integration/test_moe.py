"""The MoE model (qwen3_moe) trained by the nnstrain binary under existing plans.

- The balancing and z losses are exact under every plan: one process with a
  batch of 4 equals 2 data-parallel ranks x 2 accumulated micro-batches of 1
  with activation recompute, 2 context-parallel ranks splitting each sequence,
  2 tensor-parallel ranks (experts replicated, sequence parallelism off), and
  2 pipeline stages (the dense layer on one, the MoE layer on the other) over
  2 micro-batches,
  in loss and grad norm within 1e-5 relative over 4 steps (clipping active).
  The same run with the coefficients at 0 has another grad norm, so the
  balancing gradient is there to compare.
- Bad MoE keys exit 2 with one line naming the key (sequence parallelism, once
  refused, runs: test_expert_parallel.py).
"""
import json
import pathlib
import subprocess

import pytest

from conftest import CONFIGS, SOURCE, device_args, nnstrain_bin_path, single_process_env

CONFIG = CONFIGS / "tiny_moe.yaml"
STEPS = 4
PLANS = {
    "one": (1, ["--micro_batch_size", "4"]),
    "dp2_accum2_recompute": (2, ["--micro_batch_size", "1", "--grad_accumulation_steps", "2",
                                 "--model.activation_checkpointing", "true"]),
    "cp2": (2, ["--micro_batch_size", "4", "--compute_config.context_parallel_size", "2"]),
    "tp2": (2, ["--micro_batch_size", "4", "--pas_policy", "hybrid", "--compute_config.plan_ngpus", "2"]),
    "pp2": (2, ["--micro_batch_size", "2", "--global_batch_size", "4", "--compute_config.pas_config.pp_size", "2"]),
    "no_balancing": (1, ["--micro_batch_size", "4", "--model.args.router_aux_loss_coef", "0",
                         "--model.args.router_z_loss_coef", "0"]),
}


def metrics(run_dir):
    return [json.loads(l) for l in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in l and '"grad_norm"' in l]


@pytest.fixture(scope="module")
def run(tiny_tokens, tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            nproc, extra = PLANS[name]
            run_dir = tmp_path_factory.mktemp(name)
            train = ["--config", str(CONFIG), "--vars.data", str(tiny_tokens), "--run_dir", str(run_dir),
                     "--max_train_steps", str(STEPS), *device_args(nproc), *extra]
            args = [str(nnstrain_bin_path()), *train] if nproc == 1 else \
                [str(nnstrain_bin_path()), "launch", "--nproc-per-node", str(nproc), "--", *train]
            p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True,
                               timeout=150)
            assert p.returncode == 0, f"{name}: {' '.join(args)}\n{p.stdout}{p.stderr}"
            rows = {r["step"]: r for r in metrics(run_dir)}
            assert sorted(rows) == list(range(1, STEPS + 1)), p.stdout + p.stderr
            cache[name] = (rows, p.stdout + p.stderr)
        return cache[name]
    return get


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("name", ["dp2_accum2_recompute", "cp2", "tp2", "pp2"])
def test_plans_agree_with_one_process(run, name):
    want, _ = run("one")
    got, out = run(name)
    worst = max(max(rel(got[s]["loss"], want[s]["loss"]), rel(got[s]["grad_norm"], want[s]["grad_norm"]))
                for s in want)
    print(f"\n{name} vs one process: max relative loss / grad-norm difference {worst:.3g}")
    assert worst < 1e-5, f"{name}: {[(got[s]['loss'], want[s]['loss']) for s in want]}"
    assert any(r["grad_norm"] > 0.95 for r in want.values())  # clipping active


def test_balancing_changes_the_gradient_not_the_first_loss(run):
    on, _ = run("one")
    off, _ = run("no_balancing")
    assert rel(off[1]["loss"], on[1]["loss"]) < 1e-6  # the logged loss holds no balancing term
    assert rel(off[1]["grad_norm"], on[1]["grad_norm"]) > 1e-3


@pytest.mark.parametrize("overrides,key", [
    (["--model.args.num_experts_per_tok", "7"], "num_experts_per_tok"),
    (["--model.args.scoring_func", "sigmoid", "--model.args.n_group", "4"], "n_group"),
    (["--model.args.scoring_func", "sigmoid", "--model.args.n_group", "3", "--model.args.topk_group", "4"],
     "topk_group"),
    (["--model.args.n_group", "2"], "n_group"),
])
def test_bad_input_exits_2_naming_the_key(tiny_tokens, overrides, key):
    p = subprocess.run([str(nnstrain_bin_path()), "--config", str(CONFIG), "--vars.data", str(tiny_tokens),
                        *overrides, "--print-config"], cwd=SOURCE, env=single_process_env(1),
                       capture_output=True, text=True, timeout=60)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(lines) == 1 and key in lines[0], p.stderr


def test_deepseek_selection_biases_survive_pipeline_checkpoints(tmp_path, tiny_tokens):
    """Issue 58, item 3: DeepSeek-V3's selection bias on both layers (both sparse), trained under
    pp 2 (one layer per stage) and saved: the checkpoint holds each layer's moved bias (not a
    stage's zeros for the layer it does not hold), and resuming its step 2 under pp 1 continues
    each layer's bias from the saved one."""
    from safetensors.numpy import load_file
    deepseek = ["--model.args.scoring_func", "sigmoid", "--model.args.bias_update_speed", "0.01",
                "--model.args.mlp_only_layers", "[]", "--model.args.router_aux_loss_coef", "0",
                "--checkpoint.every_n_train_steps", "2"]

    def train(name, nproc, *extra):
        run_dir = tmp_path / name
        args = ["--config", str(CONFIG), "--vars.data", str(tiny_tokens), "--run_dir", str(run_dir),
                "--max_train_steps", "4", "--checkpoint.save_dir", str(run_dir / "ck"), *deepseek,
                *device_args(nproc), *map(str, extra)]
        cmd = [str(nnstrain_bin_path()), *args] if nproc == 1 else \
            [str(nnstrain_bin_path()), "launch", "--nproc-per-node", str(nproc), "--", *args]
        p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=150)
        assert p.returncode == 0, f"{name}\n{p.stdout}{p.stderr}"
        return run_dir / "ck"

    def biases(ck):
        out = tmp_path / f"merged-{ck.parent.parent.name}-{ck.name}"
        m = subprocess.run([str(nnstrain_bin_path()), "merge", str(ck), "--out", str(out)], cwd=SOURCE,
                           env=single_process_env(1), capture_output=True, text=True, timeout=120)
        assert m.returncode == 0, m.stdout + m.stderr
        return {k: v for k, v in load_file(out / "state.safetensors").items() if k.endswith(".expert_bias")}

    one = biases(train("one", 1, "--micro_batch_size", "4") / "step-00000004")
    assert sorted(one) == ["moe/layers.0.mlp.expert_bias", "moe/layers.1.mlp.expert_bias"], sorted(one)
    assert all(abs(b).max() >= 0.01 for b in one.values()), one  # both moved
    pp = train("pp2", 2, "--micro_batch_size", "2", "--compute_config.pas_config.pp_size", "2")
    # Each stage saved its own layer's bias, moved by its updates (before the fix: the other
    # stage's zeros for layer 0 won).
    at2, at4 = biases(pp / "step-00000002"), biases(pp / "step-00000004")
    for got in (at2, at4):
        assert sorted(got) == sorted(one), sorted(got)
        assert all(abs(b).max() >= 0.01 for b in got.values()), got
    # Resumed under pp 1 from step 2: each layer's bias continues from the saved one (two more
    # updates of at most the speed each), not from zero.
    resumed = biases(train("resumed", 1, "--micro_batch_size", "4", "--resume", pp / "step-00000002")
                     / "step-00000004")
    for k in one:
        assert abs(resumed[k] - at2[k]).max() <= 0.02 + 1e-6, f"{k}: {resumed[k]} from {at2[k]}"
        assert abs(resumed[k]).max() >= 0.01, resumed
