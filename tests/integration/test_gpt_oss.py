"""GPT-OSS (issue 51): transformers' GptOssForCausalLM from a folder alone.

transformers builds an odd random configuration (vocabulary, widths and heads not powers of
two, GQA with an explicit head_dim, sliding and full layers alternating with a window shorter
than the sequence, YaRN without truncation, 6 biased experts with top-2 routing whose clamped
SwiGLU limit the activations reach) and saves it with save_pretrained. nnstrain is given
`model: {init_from: DIR}` and nothing else about the model, and:
- its first-step loss is transformers' loss on the same batch (1e-6 relative), and its
  log-probabilities (`nnstrain eval`'s multiple-choice log-likelihoods, char-level, sequences past
  the window) are those of transformers' logits (1e-5 relative);
- the sinks and the clamp matter: transformers' loss moves with them zeroed / unclamped;
- `merge --hf` of a run that moved no weight writes every tensor bitwise equal under
  transformers' names, and AutoModelForCausalLM loads it with no missing or unexpected key;
- 10 steps under tp 2, pp 2, ZeRO-3 dp 2 and ep 2 equal one process within 1e-5, each run's
  record showing its plan ran; cp 2 is refused naming attention_sinks;
- `nnstrain generate` greedy, 64 tokens with the KV cache (past the window), equals
  transformers' generate(do_sample=False);
- config.json values it cannot take (an unknown layer type, a wrong layer_types length) exit 2
  naming the file and the key.
"""
import json
import random
import subprocess

import numpy as np
import pytest

from conftest import SOURCE, nnstrain_bin_path, read_metrics, run_ranks, single_process_env, train_window_starts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 32
STEPS = 10
PROMPT = [5, 17, 3, 30, 8, 1, 44, 12]
LIMIT = 0.6  # the clamped SwiGLU's limit: gate and up values pass it (checked below)
HF_CONFIG = dict(vocab_size=67, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=96, rms_norm_eps=1e-5,
                 sliding_window=12, num_local_experts=6, num_experts_per_tok=2, swiglu_limit=LIMIT,
                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                 rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 48,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0})

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

PP, CP, TP = "--compute_config.pas_config.pp_size", "--compute_config.context_parallel_size", "--compute_config.plan_ngpus"
PLANS = {  # name: (ranks, overrides)
    "one": (1, []),
    "tp2": (2, [TP, "2", "--pas_policy", "tp"]),
    "pp2": (2, [PP, "2", "--micro_batch_size", "2", "--grad_accumulation_steps", "2"]),
    "zero3_dp2": (2, ["--micro_batch_size", "2", "--compute_config.use_zero", "3"]),
    "ep2": (2, ["--micro_batch_size", "2", "--compute_config.expert_parallel_size", "2"]),
}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def nnstrain(*args):
    return subprocess.run([nnstrain_bin_path(), *map(str, args)], cwd=SOURCE, env=single_process_env(1),
                          capture_output=True, text=True, timeout=300)


def config_file(path, hf, data, run, steps=STEPS):
    path.write_text(CONFIG.format(run=run, hf=hf, data=data, seq=SEQ, steps=steps))
    return path


def hf_loss(model, x, y):
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()


@pytest.fixture(scope="module")
def oss(tmp_path_factory, tiny_tokens):
    """The tiny model saved by transformers, its loss on the trainer's first batch and its greedy text."""
    d = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)  # seed 3 gives a greedy text of three tokens
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**HF_CONFIG)).float().eval()
    with torch.no_grad():  # norms' gains around 1, sinks and router biases of order 1, the rest small and random
        for n, p in model.named_parameters():
            big = n.endswith("sinks") or n.endswith("router.bias")
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if n.endswith("norm.weight") else (1.0 if big else 0.15) * torch.randn_like(p))
    model.save_pretrained(d / "hf")
    tok = np.fromfile(tiny_tokens, dtype="<u2").astype(np.int64)
    starts = train_window_starts(len(tok), 1337, 0, 4, SEQ)
    x = torch.tensor(np.stack([tok[s:s + SEQ] for s in starts]))
    y = torch.tensor(np.stack([tok[s + 1:s + SEQ + 1] for s in starts]))
    loss = hf_loss(model, x, y)
    # What the test would miss if nnstrain dropped a feature: each moves transformers' own loss.
    seen = []
    hook = model.model.layers[0].mlp.experts.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    hf_loss(model, x, y)
    hook.remove()
    layer0 = model.model.layers[0].mlp.experts
    reach = (seen[0] @ layer0.gate_up_proj[0] + layer0.gate_up_proj_bias[0]).abs().max().item()
    moved = {}
    with torch.no_grad():
        sinks = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: plain softmax
        moved["sinks"] = hf_loss(model, x, y)
        for layer, s in zip(model.model.layers, sinks):
            layer.self_attn.sinks.copy_(s)
        for layer in model.model.layers:
            layer.mlp.experts.limit = 1e9
        moved["clamp"] = hf_loss(model, x, y)
        for layer in model.model.layers:
            layer.mlp.experts.limit = LIMIT
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=64, min_new_tokens=64)
    return {"dir": d, "hf": d / "hf", "loss": loss, "greedy": out[0, len(PROMPT):].tolist(), "tokens": tiny_tokens,
            "moved": moved, "reach": reach}


def test_first_loss_and_merge_hf_round_trip(oss):
    """A folder alone builds the model; its first loss is transformers'; merge --hf gives the tensors back bitwise."""
    from safetensors.torch import load_file
    assert oss["reach"] > LIMIT, oss["reach"]  # the clamp is reached
    for what, moved in oss["moved"].items():
        assert rel(moved, oss["loss"]) > 1e-3, (what, moved, oss["loss"])
    d = oss["dir"] / "roundtrip"
    cfg = config_file(oss["dir"] / "roundtrip.yaml", oss["hf"], oss["tokens"], d / "run", steps=1)
    # lr 1e-30 moves no fp32 weight of magnitude ~0.1: the saved weights are the loaded ones.
    p = nnstrain("--config", cfg, "--optimizer.args.lr", "1e-30", "--optimizer.args.weight_decay", "0",
                 "--lr_scheduler.args.min_lr", "1e-31", "--checkpoint.save_dir", d / "ck",
                 "--checkpoint.every_n_train_steps", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    resolved = (d / "run" / "config.yaml").read_text()
    assert "type: gpt_oss" in resolved, resolved  # the type came from config.json's model_type
    train, _ = read_metrics(d / "run" / "metrics.jsonl")
    print(f"gpt_oss first loss: nnstrain {train[0]['loss']!r} transformers {oss['loss']!r} "
          f"(rel {rel(train[0]['loss'], oss['loss']):.2e})")
    assert rel(train[0]["loss"], oss["loss"]) <= 1e-6, (train[0]["loss"], oss["loss"])
    m = nnstrain("merge", d / "ck" / "step-00000001", "--out", d / "merged", "--hf")
    assert m.returncode == 0, m.stdout + m.stderr
    a, b = load_file(oss["hf"] / "model.safetensors"), load_file(d / "merged" / "model.safetensors")
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    back, info = transformers.AutoModelForCausalLM.from_pretrained(d / "merged", output_loading_info=True)
    assert type(back).__name__ == "GptOssForCausalLM", type(back).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for key in ("layer_types", "sliding_window", "swiglu_limit", "swiglu_alpha", "num_local_experts", "rope_parameters"):
        assert getattr(back.config, key) == getattr(transformers.AutoConfig.from_pretrained(oss["hf"]), key), key


def test_logprobs_equal_transformers_logits(oss, tmp_path):
    """Sums of log-softmax(logits) over each choice's tokens: nnstrain eval against transformers' logits."""
    chars = list(" abcdefghijklmnopqrstuvwxyz.")
    (tmp_path / "meta.json").write_text(json.dumps({"level": "char", "itos": chars}))
    rng = random.Random(5)
    words = "the cat sat on a mat and ran to see my dog who is fat but not quick red blue tree".split()
    say = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    docs = [{"question": say(6) + ".", "choices": [say(rng.randint(1, 4)) for _ in range(3)], "label": 0}
            for _ in range(6)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "mc.yaml").write_text(
        f"task: oss_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n")
    p = nnstrain("eval", oss["hf"], "--tasks", tmp_path / "mc.yaml", "--tokenizer", tmp_path / "meta.json",
                 "--json", tmp_path / "out.json", "--device", "cpu", "--batch-size", 4)
    assert p.returncode == 0, p.stdout + p.stderr
    ours = json.loads((tmp_path / "out.json").read_text())["oss_mc"]["per_doc"]
    model = transformers.AutoModelForCausalLM.from_pretrained(oss["hf"]).float().eval()
    enc = lambda s: [chars.index(c) for c in s]  # noqa: E731
    worst, longest = 0.0, 0
    for doc, got in zip(docs, ours):
        for choice, ll in zip(doc["choices"], got["lls"]):
            ctx, cont = enc(doc["question"]), enc(" " + choice)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[0].float(), -1)
            want = sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))
            worst, longest = max(worst, rel(ll, want)), max(longest, ids.size(1))
            assert rel(ll, want) <= 1e-5, (doc, choice, ll, want)
    assert longest > HF_CONFIG["sliding_window"] * 2  # the sliding layers' window cut in
    print(f"gpt_oss log-likelihoods: worst relative difference {worst:.2e} over {len(docs) * 3} choices")


def test_plans_equal_one_process(oss):
    """10 steps under tp 2, pp 2, ZeRO-3 dp 2 and ep 2 equal one process; cp 2 refused naming the sinks."""
    runs = {}
    for plan, (ranks, overrides) in PLANS.items():
        d = oss["dir"] / plan
        cfg = config_file(oss["dir"] / f"{plan}.yaml", oss["hf"], oss["tokens"], d)
        runs[plan] = run_ranks(ranks, d, ["--config", cfg, *overrides], overrides)
    one = runs.pop("one")
    assert len(one) == STEPS and rel(one[1][0], oss["loss"]) <= 1e-6
    assert one[STEPS][0] < one[1][0] - 0.05, one  # it learned: the plans compare a moving run
    worst = {plan: max(rel(got[s][0], one[s][0]) for s in one) for plan, got in runs.items()}
    print(f"gpt_oss plans' worst loss difference: {worst}")
    for plan, w in worst.items():
        assert w <= 1e-5, (plan, runs[plan], one)
    cfg = config_file(oss["dir"] / "cp2.yaml", oss["hf"], oss["tokens"], oss["dir"] / "cp2")
    p = subprocess.run([nnstrain_bin_path(), "launch", "--nproc-per-node", "2", "--", "--config", str(cfg), CP, "2"],
                       cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "model.args.attention_sinks" in p.stderr + p.stdout, p.stdout + p.stderr


def test_generate_greedy_equals_transformers(oss):
    want = oss["greedy"]
    assert len(set(want)) > 5, f"a degenerate reference: {want}"
    p = nnstrain("generate", oss["hf"], "--prompt-ids", ",".join(map(str, PROMPT)), "--temperature", 0,
                 "--max-new-tokens", 64, "--json", "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    (s,) = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert s["ids"] == want, f"nnstrain {s['ids']}\ntransformers {want}"


def test_bad_config_json_exits_2_naming_file_and_key(oss, tmp_path):
    j = json.loads((oss["hf"] / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for layer_types in (["sliding_attention", "chunked_attention", "full_attention"], ["full_attention"] * 2):
        (bad / "config.json").write_text(json.dumps({**j, "layer_types": layer_types}))
        p = nnstrain("--config", config_file(tmp_path / "b.yaml", bad, oss["tokens"], tmp_path / "r", 1))
        assert p.returncode == 2 and "layer_types" in p.stderr and "config.json" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    cfg = config_file(tmp_path / "c.yaml", oss["hf"], oss["tokens"], tmp_path / "r", 1)
    p = nnstrain("--config", cfg, "--model.args.swiglu_limit", "3.0")  # model.args beside the folder must agree
    assert p.returncode == 2 and "model.args.swiglu_limit" in p.stderr and "config.json" in p.stderr, p.stderr
    plan = nnstrain("plan", "--config", cfg)
    assert plan.returncode == 0, plan.stdout + plan.stderr


def test_planner_counts_the_math_form(oss, tmp_path):
    """Sink attention runs the math form: the planner counts each layer's whole score square (a
    sliding layer's band is masked after the products, not skipped), so the window changes no FLOP."""
    def compute_s(folder):
        cfg = config_file(tmp_path / f"{folder.name}.yaml", folder, oss["tokens"], tmp_path / "r", 1)
        p = nnstrain("plan", "--config", cfg, "--device", "H100", "--json")
        assert p.returncode == 0, p.stdout + p.stderr
        return json.loads(p.stdout)["plan"]["estimate"]["compute_s"]
    full = tmp_path / "full"
    full.mkdir()
    j = json.loads((oss["hf"] / "config.json").read_text())
    assert "sliding_attention" in j["layer_types"]
    (full / "config.json").write_text(json.dumps({**j, "layer_types": ["full_attention"] * len(j["layer_types"])}))
    (full / "model.safetensors").symlink_to(oss["hf"] / "model.safetensors")
    assert compute_s(oss["hf"]) == compute_s(full)
