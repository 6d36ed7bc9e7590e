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


ADD_BIAS = r"""
import json, sys, torch
from safetensors.torch import load_file, save_file
d = sys.argv[1]
t = load_file(d + "/model.safetensors")
t["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.tensor([0.3, -0.2, 0.1, 0.0, -0.05, 0.25])
save_file(t, d + "/model.safetensors", metadata={"format": "pt"})
c = json.load(open(d + "/config.json"))
c["scoring_func"] = "sigmoid"
json.dump(c, open(d + "/config.json", "w"))
"""


def test_folder_selection_bias_is_used_at_speed_0_and_merge_hf_refuses_deepseek_routing(tmp_path, tiny_tokens):
    """Issue 58, items 6 and 8. A Qwen3-MoE folder with DeepSeek-V3's `e_score_correction_bias`
    (scoring_func sigmoid) read by init_from at bias_update_speed 0: the checkpoint holds the folder's
    bias unchanged (a fixed bias, as in inference). merge --hf of that checkpoint is refused naming
    scoring_func: transformers' Qwen3MoeForCausalLM would route by softmax without error."""
    from safetensors.numpy import load_file
    hf = tmp_path / "hf"
    py("-c", MAKE, hf, "qwen3_moe")
    py("-c", ADD_BIAS, hf)
    args = ["--config", CONFIGS / "tiny_moe.yaml", "--vars.data", tiny_tokens, "--run_dir", tmp_path / "run",
            "--micro_batch_size", "4", "--max_train_steps", "2", "--checkpoint.save_dir", tmp_path / "ck",
            "--model.args.scoring_func", "sigmoid", "--model.args.router_aux_loss_coef", "0",
            "--model.init_from", hf, "--model.args.initializer_range", "0.02", *device_args(1)]
    p = subprocess.run([nnstrain_bin_path(), *map(str, args)], cwd=SOURCE, env=single_process_env(1),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    ck = sorted((tmp_path / "ck").glob("step-*"))[-1]
    m = subprocess.run([nnstrain_bin_path(), "merge", ck, "--out", tmp_path / "merged"], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert m.returncode == 0, m.stdout + m.stderr
    state = load_file(tmp_path / "merged" / "state.safetensors")
    assert "moe/layers.1.mlp.expert_bias" in state, sorted(state)
    want = [0.3, -0.2, 0.1, 0.0, -0.05, 0.25]
    assert abs(state["moe/layers.1.mlp.expert_bias"] - want).max() <= 1e-7, state["moe/layers.1.mlp.expert_bias"]
    h = subprocess.run([nnstrain_bin_path(), "merge", ck, "--out", tmp_path / "merged_hf", "--hf"], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=300)
    out = h.stdout + h.stderr
    assert h.returncode != 0 and "scoring_func" in out and "Qwen3MoeForCausalLM" in out, out
    assert "terminate called" not in out and not (tmp_path / "merged_hf").exists(), out


@pytest.mark.parametrize("overrides,key", [
    (["--model.args.n_shared_experts", "1"], "n_shared_experts"),
    (["--model.args.shared_expert_intermediate_size", "8"], "shared_expert_intermediate_size"),
])
def test_merge_hf_refuses_what_transformers_would_drop(tmp_path, tiny_tokens, overrides, key):
    """Issue 58, item 6: shared experts have no place in Qwen3MoeForCausalLM: merge --hf refuses,
    naming the option, rather than writing a folder transformers loads without them."""
    args = ["--config", CONFIGS / "tiny_moe.yaml", "--vars.data", tiny_tokens, "--run_dir", tmp_path / "run",
            "--micro_batch_size", "4", "--max_train_steps", "1", "--checkpoint.save_dir", tmp_path / "ck",
            *overrides, *device_args(1)]
    p = subprocess.run([nnstrain_bin_path(), *map(str, args)], cwd=SOURCE, env=single_process_env(1),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    ck = sorted((tmp_path / "ck").glob("step-*"))[-1]
    h = subprocess.run([nnstrain_bin_path(), "merge", ck, "--out", tmp_path / "merged_hf", "--hf"], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=300)
    out = h.stdout + h.stderr
    assert h.returncode != 0 and key in out, out
    assert len([l for l in h.stderr.splitlines() if l.strip()]) == 1, out
