"""DeepSeek-V3 (issue 51): multi-head latent attention on Llama's stack with DeepSeek's MoE, from a folder alone.

transformers builds an odd random DeepseekV3ForCausalLM (vocabulary 67, 6 heads, q and kv low-rank
projections of ranks 18 and 12, no-rope / rope / value head parts 6 / 4 / 10, interleaved rope with
YaRN and mscale_all_dim (so the softmax scale moves too), one dense first layer, 6 routed experts in
3 groups with a random selection bias, a shared expert, routed_scaling_factor 2.5) and saves it.
nnstrain is given `model: {init_from: DIR}` and:
- its first-step loss is transformers' (1e-6 relative), also with q_proj (q_lora_rank null) and rope
  not interleaved;
- `merge --hf` writes every tensor bitwise (e_score_correction_bias included) and
  AutoModelForCausalLM loads it with no missing or unexpected key;
- 10 steps under tp 2 (sequence parallel and not), pp 2, cp 2, ZeRO-3 dp 2 and ep 2 equal one
  process within 1e-5, each run's record showing its plan ran;
- `nnstrain generate` greedy (64 tokens over the compressed KV cache) equals transformers' generate;
- config.json values it would misread exit 2 naming the file and the key.
"""
import json
import subprocess

import numpy as np
import pytest

from conftest import SOURCE, nnstrain_bin_path, read_metrics, run_ranks, single_process_env, train_window_starts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 32
STEPS = 10
PROMPT = [5, 17, 3, 30, 8, 1, 44, 12]
SHAPE = dict(vocab_size=67, hidden_size=48, intermediate_size=72, moe_intermediate_size=20, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=6, q_lora_rank=18, kv_lora_rank=12, qk_nope_head_dim=6,
             qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=6, n_group=3, topk_group=2, num_experts_per_tok=3,
             n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
             max_position_embeddings=96, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 48,
                              "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 0.8},
             bos_token_id=None, eos_token_id=None, pad_token_id=None)

CONFIG = """
run_dir: {run}
pas_policy: dp
compute_config: {{device: cpu, backend: gloo, reducer_bucket_cap_mb: 0.01, collective_timeout_s: 60}}
model:
  init_from: {hf}
optimizer:
  type: adamw
  args: {{lr: 3.0e-3, betas: [0.9, 0.99], eps: 1.0e-8, weight_decay: 0.1}}
  clip_gnorm: 0.95
lr_scheduler: {{type: cosine, args: {{warmup_steps: 2, decay_steps: 10, min_lr: 3.0e-4}}}}
dataset:
  type: token_bin
  train_args: {{path: {data}, dtype: uint16, seq_len: {seq}}}
micro_batch_size: 4
max_train_steps: {steps}
log_progress_every_n_train_steps: 1
seed: 1337
"""

TP, PP, CP, EP = ("--compute_config.plan_ngpus", "--compute_config.pas_config.pp_size",
                  "--compute_config.context_parallel_size", "--compute_config.expert_parallel_size")
PLANS = {  # name: (ranks, overrides)
    "one": (1, []),
    "tp2_sp": (2, [TP, "2", "--pas_policy", "tp"]),
    "tp2": (2, [TP, "2", "--pas_policy", "tp", "--compute_config.sequence_parallel", "false"]),
    "pp2": (2, [PP, "2", "--micro_batch_size", "2", "--grad_accumulation_steps", "2"]),
    "cp2": (2, [CP, "2"]),
    "zero3_dp2": (2, ["--micro_batch_size", "2", "--compute_config.use_zero", "3"]),
    "ep2": (2, ["--micro_batch_size", "2", EP, "2"]),
}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def nnstrain(*args):
    return subprocess.run([nnstrain_bin_path(), *map(str, args)], cwd=SOURCE, env=single_process_env(1),
                          capture_output=True, text=True, timeout=300)


def config_file(path, hf, data, run, steps=STEPS):
    path.write_text(CONFIG.format(run=run, hf=hf, data=data, seq=SEQ, steps=steps))
    return path


def saved_model(d, **changes):
    """A random DeepseekV3ForCausalLM saved under d, and its loss on the trainer's first batch."""
    torch.manual_seed(3)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SHAPE, **changes})).float().eval()
    with torch.no_grad():  # norms' gains random around 1, everything else small and random: a misplaced one shows
        for n, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if n.endswith("norm.weight") else 0.15 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # a trained selection bias, which changes the choice
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(d)
    return model


def first_batch(tokens):
    tok = np.fromfile(tokens, dtype="<u2").astype(np.int64)
    starts = train_window_starts(len(tok), 1337, 0, 4, SEQ)
    x = torch.tensor(np.stack([tok[s:s + SEQ] for s in starts]))
    y = torch.tensor(np.stack([tok[s + 1:s + SEQ + 1] for s in starts]))
    return x, y


def hf_loss(model, tokens):
    x, y = first_batch(tokens)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()


@pytest.fixture(scope="module")
def family(tmp_path_factory, tiny_tokens):
    d = tmp_path_factory.mktemp("deepseek_v3")
    model = saved_model(d / "hf")
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=64, min_new_tokens=64)
    return {"dir": d, "hf": d / "hf", "loss": hf_loss(model, tiny_tokens), "greedy": out[0, len(PROMPT):].tolist(),
            "tokens": tiny_tokens}


def first_loss(d, hf, tokens):
    cfg = config_file(d / "one.yaml", hf, tokens, d / "run", steps=1)
    p = nnstrain("--config", cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    return read_metrics(d / "run" / "metrics.jsonl")[0][0]["loss"]


def test_first_loss_and_merge_hf_round_trip(family):
    from safetensors.torch import load_file
    d = family["dir"] / "roundtrip"
    cfg = config_file(family["dir"] / "roundtrip.yaml", family["hf"], family["tokens"], d / "run", steps=1)
    # lr 1e-30 moves no fp32 weight of magnitude ~0.1: the saved weights are the loaded ones.
    p = nnstrain("--config", cfg, "--optimizer.args.lr", "1e-30", "--optimizer.args.weight_decay", "0",
                 "--lr_scheduler.args.min_lr", "1e-31", "--checkpoint.save_dir", d / "ck",
                 "--checkpoint.every_n_train_steps", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "type: deepseek_v3" in (d / "run" / "config.yaml").read_text()
    train, _ = read_metrics(d / "run" / "metrics.jsonl")
    print(f"deepseek_v3 first loss: nnstrain {train[0]['loss']!r} transformers {family['loss']!r}")
    assert rel(train[0]["loss"], family["loss"]) <= 1e-6, (train[0]["loss"], family["loss"])
    m = nnstrain("merge", d / "ck" / "step-00000001", "--out", d / "merged", "--hf")
    assert m.returncode == 0, m.stdout + m.stderr
    a, b = load_file(family["hf"] / "model.safetensors"), load_file(d / "merged" / "model.safetensors")
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    assert any(k.endswith("e_score_correction_bias") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    back, info = transformers.AutoModelForCausalLM.from_pretrained(d / "merged", output_loading_info=True)
    assert type(back).__name__ == "DeepseekV3ForCausalLM", type(back).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert rel(hf_loss(back.float().eval(), family["tokens"]), family["loss"]) <= 1e-6


def test_q_proj_and_rope_not_interleaved(tmp_path, tiny_tokens):
    """q_lora_rank null (one q_proj) and rope_interleave false: the other two forms of the attention."""
    model = saved_model(tmp_path / "hf", q_lora_rank=None, rope_interleave=False)
    assert model.model.layers[0].self_attn.q_proj is not None
    got, want = first_loss(tmp_path, tmp_path / "hf", tiny_tokens), hf_loss(model, tiny_tokens)
    assert rel(got, want) <= 1e-6, (got, want)


def test_plans_equal_one_process(family):
    runs = {}
    for plan, (ranks, overrides) in PLANS.items():
        d = family["dir"] / plan
        cfg = config_file(family["dir"] / f"{plan}.yaml", family["hf"], family["tokens"], d)
        runs[plan] = run_ranks(ranks, d, ["--config", cfg, *overrides], overrides)
    one = runs.pop("one")
    assert len(one) == STEPS and rel(one[1][0], family["loss"]) <= 1e-6
    assert one[STEPS][0] < one[1][0] - 0.05, one  # it learned: the plans compare a moving run
    worst = {plan: max(rel(got[s][0], one[s][0]) for s in one) for plan, got in runs.items()}
    print(f"deepseek_v3 plans' worst loss difference: {worst}")
    for plan, w in worst.items():
        assert w <= 1e-5, (plan, runs[plan], one)


def test_generate_greedy_equals_transformers(family):
    want = family["greedy"]
    assert len(set(want)) > 5, f"a degenerate reference: {want}"
    p = nnstrain("generate", family["hf"], "--prompt-ids", ",".join(map(str, PROMPT)), "--temperature", 0,
                 "--max-new-tokens", 64, "--json", "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    (s,) = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert s["ids"] == want, f"nnstrain {s['ids']}\ntransformers {want}"


def test_bad_config_json_exits_2_naming_the_key(family, tmp_path):
    cfg = config_file(tmp_path / "c.yaml", family["hf"], family["tokens"], tmp_path / "run", steps=1)
    plan = nnstrain("plan", "--config", cfg)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    p = nnstrain("--config", cfg, "--model.args.kv_lora_rank", "16")  # model.args must agree with config.json
    assert p.returncode == 2 and "model.args.kv_lora_rank" in p.stderr and "config.json" in p.stderr, p.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    j = json.loads((family["hf"] / "config.json").read_text())
    for key, value in [("head_dim", 6), ("num_key_value_heads", 3), ("kv_lora_rank", 0), ("qk_rope_head_dim", 5),
                       ("rope_parameters", {"rope_type": "ntk-by-parts", "rope_theta": 1e4}),
                       ("hidden_act", "gelu"), ("scoring_func", "softmax")]:
        (bad / "config.json").write_text(json.dumps({**j, key: value}))
        p = nnstrain("--config", config_file(tmp_path / "b.yaml", bad, family["tokens"], tmp_path / "r2", 1))
        named = "rope_type" if key == "rope_parameters" else key
        assert p.returncode == 2 and named in p.stderr and "config.json" in p.stderr, (key, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_plan_declares_the_latent_split(family, tmp_path):
    """Under tp 2 the planner sees the heads split (q_b_proj and kv_b_proj by rows, o_proj by columns)
    and the low-rank a-projections and their norms replicated, and counts transformers' parameters."""
    cfg = config_file(tmp_path / "c.yaml", family["hf"], family["tokens"], tmp_path / "run", steps=1)
    p = nnstrain("plan", "--config", cfg, "--runtime-ngpus", 2, "--pas_policy", "tp", TP, 2, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    plan = json.loads(p.stdout)["plan"]
    assert plan["tp"] == 2, plan["tp"]
    split = {q["param"]: (q["split"], q["global_shape"], q["local_shape"]) for q in plan["params"]}
    attn = "layers.0.self_attn."
    assert split[attn + "q_b_proj.weight"] == ("column", [60, 18], [30, 18]), split[attn + "q_b_proj.weight"]
    assert split[attn + "kv_b_proj.weight"] == ("column", [96, 12], [48, 12]), split[attn + "kv_b_proj.weight"]
    assert split[attn + "o_proj.weight"] == ("row", [48, 60], [48, 30]), split[attn + "o_proj.weight"]
    for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        assert split[f"{attn}{name}.weight"][0] == "replicate", (name, split[f"{attn}{name}.weight"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(family["hf"])
    assert sum(int(np.prod(s[1])) for s in split.values()) == sum(q.numel() for q in hf.parameters())


def test_model_args_alone_train_and_export(family, tmp_path):
    """model.type deepseek_v3 from model.args (head_dim defaults to qk_rope_head_dim, as DeepseekV3Config's):
    trained, merged with --hf, and loaded by transformers with no missing key, which gives its loss back."""
    args = {k: v for k, v in SHAPE.items() if k not in ("rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")}
    cfg = tmp_path / "args.yaml"
    cfg.write_text(CONFIG.format(run=tmp_path / "run", hf="", data=family["tokens"], seq=SEQ, steps=2).replace(
        "  init_from: \n", f"  type: deepseek_v3\n  args: {json.dumps(args)}\n"))
    p = nnstrain("--config", cfg, "--checkpoint.save_dir", tmp_path / "ck", "--checkpoint.every_n_train_steps", 2)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "head_dim: 4" in (tmp_path / "run" / "config.yaml").read_text()
    m = nnstrain("merge", tmp_path / "ck" / "step-00000002", "--out", tmp_path / "hf", "--hf")
    assert m.returncode == 0, m.stdout + m.stderr
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # The merged folder as init_from: nnstrain's first loss on it is transformers'.
    d = tmp_path / "again"
    d.mkdir()
    assert rel(first_loss(d, tmp_path / "hf", family["tokens"]), hf_loss(back.float().eval(), family["tokens"])) <= 1e-6


def test_lora_on_the_a_projections_under_sequence_parallelism_exits_2(family, tmp_path):
    """LoRA on q_a_proj / kv_a_proj_with_mqa (unsplit layers that see this rank's tokens under sequence
    parallelism): refused at load, naming the key and the layer; without sequence parallelism it trains."""
    cfg = config_file(tmp_path / "c.yaml", family["hf"], family["tokens"], tmp_path / "run", steps=1)
    cfg.write_text(cfg.read_text() + "lora: {r: 4, alpha: 8, target_modules: [q_a_proj, q_b_proj]}\n")
    launch = [nnstrain_bin_path(), "launch", "--nproc-per-node", "2", "--", "--config", str(cfg), TP, "2",
              "--pas_policy", "tp"]
    p = subprocess.run(launch, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "lora.target_modules: model.layers.0.self_attn.q_a_proj" in p.stderr and "sequence_parallel" in p.stderr, \
        p.stderr
    p = subprocess.run(launch + ["--compute_config.sequence_parallel", "false"], cwd=SOURCE,
                       env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
