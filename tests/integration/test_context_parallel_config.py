"""Context parallelism's configuration (issue 22): what cp > 1 refuses, each with
exit status 2 and a message naming the keys: a sequence cp cannot split (seq_len
and the degree), a degree that does not divide the ranks, the combinations not
supported yet (CUDA graphs, GPT's attention dropout);
and `nnstrain plan`, which plans a configured cp (the cost model's
context-parallel terms). Training under cp: test_context_parallel.py; the
attention op: tests/unit/test_context_attention.cpp."""
import json
import subprocess

from conftest import CONFIGS, SOURCE, nnstrain_bin_path, single_process_env

CONFIG = CONFIGS / "tiny_dp.yaml"


def nnstrain(*args, tmp_path, data):
    cmd = [nnstrain_bin_path(), *args, "--config", str(CONFIG), "--run_dir", str(tmp_path / "run"),
           "--vars.data", str(data), "--micro_batch_size", "1", "--max_train_steps", "1"]
    p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def test_a_sequence_cp_cannot_split_exits_2_naming_the_keys(tmp_path, tiny_tokens):
    code, out = nnstrain("--compute_config.runtime_ngpus", "4", "--compute_config.context_parallel_size", "4",
                         "--vars.seq_len", "36", tmp_path=tmp_path, data=tiny_tokens)
    assert code == 2, out
    assert ("dataset.train_args.seq_len" in out and "36 does not split over compute_config.context_parallel_size 4"
            in out and "multiple of 2 x context_parallel_size (8)" in out), out
    # Contiguous layout: a multiple of cp suffices, so 36 splits over 4 and the run stops at the next
    # check: one process launched where cp 4 needs a multiple of 4.
    code, out = nnstrain("--compute_config.runtime_ngpus", "4", "--compute_config.context_parallel_size", "4",
                         "--compute_config.cp_load_balance", "none", "--vars.seq_len", "36", tmp_path=tmp_path,
                         data=tiny_tokens)
    assert code == 2 and "seq_len" not in out, out
    assert "compute_config.context_parallel_size 4 does not divide the 1 processes launched" in out, out


def test_cp_that_does_not_divide_the_ranks_exits_2(tmp_path, tiny_tokens):
    code, out = nnstrain("--compute_config.context_parallel_size", "2", tmp_path=tmp_path, data=tiny_tokens)
    assert code == 2, out
    assert "compute_config.context_parallel_size" in out and "does not divide runtime_ngpus 1" in out, out


def test_plan_plans_the_configured_cp(tmp_path, tiny_tokens):
    code, out = nnstrain("plan", "--runtime-ngpus", "4", "--compute_config.context_parallel_size", "2", "--json",
                         tmp_path=tmp_path, data=tiny_tokens)
    assert code == 0, out
    with_cp = json.loads(out)["plan"]
    assert with_cp["context"] == {"cp": 2, "comm_type": "p2p", "load_balance": "zigzag"}, with_cp
    assert with_cp["tp"] * 2 * with_cp["dp"] == 4, with_cp
    code, out = nnstrain("plan", "--runtime-ngpus", "4", "--json", tmp_path=tmp_path, data=tiny_tokens)
    assert code == 0, out
    without = json.loads(out)["plan"]
    assert "context" not in without, without
    # Each rank holds half of every sequence's activations.
    assert with_cp["estimate"]["activation_bytes"] < without["estimate"]["activation_bytes"], (with_cp, without)
    code, out = nnstrain("plan", "--runtime-ngpus", "4", "--compute_config.context_parallel_size", "2",
                         tmp_path=tmp_path, data=tiny_tokens)
    assert code == 0 and "context parallel: each sequence over 2 ranks (p2p ring, zigzag chunks)" in out, out


def test_what_cp_does_not_support_yet_exits_2_naming_the_keys(tmp_path, tiny_tokens):
    cp2 = ("--compute_config.runtime_ngpus", "2", "--compute_config.context_parallel_size", "2")
    code, out = nnstrain(*cp2, "--model.args.dropout", "0.1", tmp_path=tmp_path, data=tiny_tokens)
    assert code == 2, out
    assert "model.args.dropout" in out and "context-parallel attention" in out and "has no attention dropout" in out, out
    code, out = nnstrain(*cp2, "--compute_config.cuda_graphs", "true", tmp_path=tmp_path, data=tiny_tokens)
    assert code == 2, out
    assert "compute_config.cuda_graphs" in out and "context_parallel_size 2" in out, out
    assert "Traceback" not in out and "frame #" not in out, out
