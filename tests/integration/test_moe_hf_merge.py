"""MoE checkpoints in the Hugging Face layout both ways (issue 38): a Qwen3-MoE and a
Mixtral written by transformers' save_pretrained (one tensor per expert) are read by
model.init_from into nnstrain's stacked experts, trained one step at lr 0 under expert
parallelism 2 (each rank reads and saves only its experts), saved, and `nnstrain merge
--hf` writes them back one tensor per expert: every tensor bitwise equal to the
original, under the original names, and the folder loads in transformers. The DeepSeek-V3
router's selection bias goes out and back in as DeepseekV3's e_score_correction_bias."""
import subprocess
import sys

import pytest

from conftest import CONFIGS, SOURCE, device_args, nnstrain_bin_path, single_process_env

MAKE = r"""
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, MixtralConfig, MixtralForCausalLM
torch.manual_seed(5)
common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0)
if sys.argv[2] == "qwen3_moe":
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0],
        decoder_sparse_step=1))
else:
    m = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=16, num_hidden_layers=2, num_local_experts=6,
        num_experts_per_tok=3))
with torch.no_grad():
    for p in m.parameters():
        p.copy_(0.1 * torch.randn_like(p))
m.save_pretrained(sys.argv[1])
"""

COMPARE = r"""
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
a, b = load_file(sys.argv[1] + "/model.safetensors"), load_file(sys.argv[2] + "/model.safetensors")
assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:10]
experts = [k for k in a if ".experts." in k]
assert len(experts) >= 18, experts  # one tensor per expert (3 per expert, 6 experts)
for k in a:
    assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
AutoModelForCausalLM.from_pretrained(sys.argv[2])  # transformers reads the merged folder
print("EQUAL", len(a))
"""


def py(*args):
    p = subprocess.run([sys.executable, *map(str, args)], cwd=SOURCE, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_init_from_and_merge_hf_round_trip_bitwise(tmp_path, tiny_tokens, model_type):
    hf = tmp_path / "hf"
    py("-c", MAKE, hf, model_type)
    config = CONFIGS / "tiny_moe.yaml"
    if model_type == "mixtral":  # the same shape in Mixtral's keys: every layer sparse, experts of intermediate_size
        text = (CONFIGS / "tiny_moe.yaml").read_text().replace("type: qwen3_moe", "type: mixtral")
        text = text.replace("    intermediate_size: 64\n", "    intermediate_size: 16\n")
        text = text.replace("    num_experts: 6\n", "    num_local_experts: 6\n")
        for gone in ("    moe_intermediate_size: 16\n", "    norm_topk_prob: true\n", "    mlp_only_layers: [0]\n"):
            assert gone in text
            text = text.replace(gone, "")
        config = tmp_path / "tiny_mixtral.yaml"
        config.write_text(text)
    # lr 1e-30 moves no fp32 weight of magnitude ~0.1 (far below half an ulp): the saved weights are the loaded ones.
    args = ["--config", config, "--vars.data", tiny_tokens, "--run_dir", tmp_path / "run",
            "--model.init_from", hf, "--max_train_steps", "1", "--optimizer.args.lr", "1e-30",
            "--optimizer.args.weight_decay", "0", "--lr_scheduler.args.min_lr", "1e-31",
            "--model.args.router_aux_loss_coef", "0.001",
            "--micro_batch_size", "2", "--compute_config.expert_parallel_size", "2",
            "--checkpoint.save_dir", tmp_path / "ck", "--checkpoint.every_n_train_steps", "1", *device_args(2)]
    p = subprocess.run([nnstrain_bin_path(), "launch", "--nproc-per-node", "2", "--", *map(str, args)], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    step = tmp_path / "ck" / "step-00000001"
    m = subprocess.run([nnstrain_bin_path(), "merge", step, "--out", tmp_path / "merged", "--hf"], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert m.returncode == 0, m.stdout + m.stderr
    assert "EQUAL" in py("-c", COMPARE, hf, tmp_path / "merged")


def test_deepseek_selection_bias_round_trips_as_e_score_correction_bias(tmp_path, tiny_tokens):
    """DeepSeek-V3's router on the tiny Qwen3-MoE: the selection bias the trainer moved is written by
    merge --hf as `<layer>.gate.e_score_correction_bias` (DeepseekV3's name) and read back by init_from."""
    from safetensors.numpy import load_file
    deepseek = ["--model.args.scoring_func", "sigmoid", "--model.args.router_aux_loss_coef", "0"]

    def train(run, *more):
        args = ["--config", CONFIGS / "tiny_moe.yaml", "--vars.data", tiny_tokens, "--run_dir", tmp_path / run,
                "--micro_batch_size", "4", "--checkpoint.save_dir", tmp_path / run / "ck", *deepseek, *more,
                *device_args(1)]
        p = subprocess.run([nnstrain_bin_path(), *map(str, args)], cwd=SOURCE, env=single_process_env(1),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        ck = sorted((tmp_path / run / "ck").glob("step-*"))[-1]
        m = subprocess.run([nnstrain_bin_path(), "merge", ck, "--out", tmp_path / run / "hf", "--hf"], cwd=SOURCE,
                           env=single_process_env(1), capture_output=True, text=True, timeout=300)
        assert m.returncode == 0, m.stdout + m.stderr
        return {k: v for k, v in load_file(tmp_path / run / "hf" / "model.safetensors").items()
                if k.endswith("e_score_correction_bias")}

    moved = train("first", "--max_train_steps", "5", "--model.args.bias_update_speed", "0.01")
    assert sorted(moved) == ["model.layers.1.mlp.gate.e_score_correction_bias"], sorted(moved)
    (bias,) = moved.values()
    assert abs(bias).max() >= 0.01, bias  # the trainer moved it (a multiple of the speed per step)
    # Read back by init_from, then moved by at most 1e-9 in one step: the same values, not a fresh zero bias.
    again = train("second", "--max_train_steps", "1", "--model.args.bias_update_speed", "1e-9",
                  "--model.init_from", tmp_path / "first" / "hf")
    assert abs(again["model.layers.1.mlp.gate.e_score_correction_bias"] - bias).max() <= 2e-9
