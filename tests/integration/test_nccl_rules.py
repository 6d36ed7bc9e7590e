"""The pipeline under NCCL's point-to-point rules (docs/parallelism.md, "Point to
point under NCCL's rules"), on CPU: Gloo in the NCCL-rules mode
(NNSTRAIN_P2P_SEMANTICS=nccl: tags ignored, a send held until its receive is
posted, a communicator's groups in order) trains the same losses as Gloo's own
behaviour, and says it ran so; a transfer order that would hang on NCCL is
refused at load with one line; a bad value of the variable is refused.

CTest sets NNSTRAIN_P2P_SEMANTICS=nccl for this file and the pipeline suites;
each case here sets the mode it needs itself.
"""
import pathlib
import subprocess

from conftest import CONFIGS, SOURCE, device_args, nnstrain_bin_path, read_metrics, single_process_env

ARGS = ["--config", str(CONFIGS / "tiny_dp.yaml"), "--micro_batch_size", "2", "--global_batch_size", "8",
        "--max_train_steps", "4", "--model.args.n_layer", "4", "--compute_config.pas_config.pp_size", "2"]
RULES_LINE = "point-to-point on Gloo under NCCL's rules"


def launch(run_dir, data, mode, *overrides, ranks=2):
    env = single_process_env(1, NNSTRAIN_P2P_SEMANTICS=mode)
    cmd = [nnstrain_bin_path(), "launch", "--nproc-per-node", str(ranks), "--", *ARGS, "--run_dir", str(run_dir),
           "--vars.data", str(data), *device_args(ranks), *map(str, overrides)]
    p = subprocess.run(cmd, cwd=SOURCE, env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def losses(run_dir):
    train, _ = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
    return [(r["step"], r["loss"], r["grad_norm"]) for r in train]


def test_rules_mode_trains_what_native_gloo_trains(tmp_path, tiny_tokens):
    """zbv at pp 2 (the schedule whose messages crossed in both orders) and
    1f1b with post-validation, tied GPT: every rank logs that it ran under the
    rules, and the losses are Gloo's own, bit for bit."""
    for name, extra in (("zbv", ["--compute_config.pas_config.pipeline_scheduler", "zbv"]),
                        ("1f1b_pv", ["--compute_config.pas_config.pipeline_post_validation", "true",
                                     "--optimizer.clip_gnorm", "100"])):
        rc, out = launch(tmp_path / f"{name}_nccl", tiny_tokens, "nccl", *extra)
        assert rc == 0, out
        for r in range(2):
            log = (tmp_path / f"{name}_nccl" / "logs" / f"rank{r}.log").read_text()
            assert RULES_LINE in log, f"rank {r} did not run under NCCL's rules:\n{log}"
        rc, out = launch(tmp_path / f"{name}_native", tiny_tokens, "native", *extra)
        assert rc == 0, out
        assert RULES_LINE not in out
        a, b = losses(tmp_path / f"{name}_nccl"), losses(tmp_path / f"{name}_native")
        assert len(a) == 4 and a == b, (name, a, b)


def test_transfers_that_would_hang_on_nccl_are_refused_at_load(tmp_path, tiny_tokens):
    """With every transfer a group of its own (the test hook restores the
    lowering before groups), 1F1B's steady state would deadlock on NCCL: the
    dry run refuses the plan before any process group exists, exit 2, one
    line naming the schedule and the first conflicting pair."""
    env = single_process_env(1, NNSTRAIN_TEST_P2P_UNGROUPED="1")
    cmd = [nnstrain_bin_path(), "launch", "--nproc-per-node", "2", "--", *ARGS, "--run_dir", str(tmp_path / "run"),
           "--vars.data", str(tiny_tokens), *device_args(2)]
    p = subprocess.run(cmd, cwd=SOURCE, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    lines = [l for l in out.splitlines() if "nnstrain: config error: compute_config.pas_config.pipeline_scheduler: " in l]
    assert len(lines) == 2, out  # one line from each rank
    assert "pipeline schedule 1f1b (pp 2, 4 micro-batches) breaks NCCL's point-to-point rules: deadlock: rank 0's " \
        "sa1.2>1 waits for rank 1's ra1.2<0, queued behind rank 1's sg0.1>0" in lines[0], lines[0]
    assert "Traceback" not in out and "frame #" not in out, out
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not losses(tmp_path / "run")


def test_a_bad_mode_is_refused_naming_the_variable(tmp_path, tiny_tokens):
    rc, out = launch(tmp_path / "bad", tiny_tokens, "gloo-ish")
    assert rc == 2, out
    assert "NNSTRAIN_P2P_SEMANTICS='gloo-ish': expected nccl" in out, out
