"""LoRA and QLoRA (issue 53) against peft, the reference, run here.

For a transformers Llama, Qwen2 (q/k/v biases) and GPT-2 (Conv1D, fused q/k/v) of odd shapes, peft builds a LoraConfig
(r 8, alpha 16, attention and MLP projections, dropout 0) whose B is made non-zero, saves it,
and trains it 20 steps with torch AdamW on the batches nnstrain's data stream draws. nnstrain
starts from the same folders (model.init_from, lora.init_from) and:
- every loss is peft's within 1e-5 relative, and the adapters `merge --adapter` writes are
  peft's final ones within 1e-5;
- peft.PeftModel.from_pretrained(base, that folder) gives the logits of transformers on
  `merge --hf`'s merged folder (W + scale x B A) within 1e-5;
- (Llama; GPT-2 tp 2) dp 2 ZeRO-3, tp 2, pp 2 and cp 2 equal one process within 1e-5, each run's record
  showing the plan ran (assert_active) and that the training state held the adapters alone
  (its parameter elements are the adapters', no other parameter in it, no frozen tensor
  requiring or holding a gradient after the first step); under ZeRO-3 each rank keeps half the
  frozen base (record lora.zero3_frozen) and the planner prices that half exactly;
- --resume refuses another base, a target that matches nothing exits 2 naming it;
- QLoRA (base_quantization nf4) against peft + bitsandbytes' Linear4bit on the CPU: losses
  within 1e-4 relative over 10 steps and a falling curve (the codes' bitwise parity with
  quantize_4bit is tests/unit/test_lora_nf4.cpp).
"""
import json
import subprocess

import numpy as np
import pytest

from conftest import (SOURCE, active_records, held_between_steps, nnstrain_bin_path, read_metrics, run_ranks,
                      single_process_env, train_window_starts)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEQ, STEPS, SEED, LR, WD, MICRO = 32, 20, 1337, 2e-3, 0.1, 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = dict(vocab_size=67, hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=96, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, use_sliding_window=False)),
    # GPT-2: Conv1D weights stored [in, out] (peft's fan_in_fan_out), q/k/v fused in c_attn (column-parallel in parts).
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=67, n_embd=48, n_layer=3, n_head=6, n_positions=96, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, activation_function="gelu", tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)),
}
FAMILY_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"]}

CONFIG = """
run_dir: {run}
pas_policy: dp
compute_config: {{device: cpu, backend: gloo, reducer_bucket_cap_mb: 0.01, collective_timeout_s: 60}}
model:
  init_from: {hf}
lora:
  r: 8
  alpha: 16
  target_modules: [{targets}]
  init_from: {init}
optimizer:
  type: adamw
  args: {{lr: {lr}, betas: [0.9, 0.99], eps: 1.0e-8, weight_decay: {wd}}}
  clip_gnorm: 0.0
lr_scheduler: {{type: constant}}
dataset:
  type: token_bin
  train_args: {{path: {data}, dtype: uint16, seq_len: {seq}}}
micro_batch_size: {micro}
max_train_steps: {steps}
log_progress_every_n_train_steps: 1
seed: {seed}
checkpoint: {{save_dir: {run}/ck}}
"""

PP, CP, TP = "--compute_config.pas_config.pp_size", "--compute_config.context_parallel_size", "--compute_config.plan_ngpus"
PLANS = {  # name: (ranks, overrides); NNSTRAIN_LORA_PLANS picks some (debugging)
    "tp2": (2, [TP, "2", "--pas_policy", "tp"]),
    "pp2": (2, [PP, "2", "--micro_batch_size", "2", "--grad_accumulation_steps", "2"]),
    "cp2": (2, [CP, "2"]),
    "zero3_dp2": (2, ["--micro_batch_size", "2", "--compute_config.use_zero", "3"]),
}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def nnstrain(*args, timeout=300):
    return subprocess.run([nnstrain_bin_path(), *map(str, args)], cwd=SOURCE, env=single_process_env(1),
                          capture_output=True, text=True, timeout=timeout)


def config_file(path, fam, run, steps=STEPS, init=None, targets=None, extra=""):
    targets = targets or FAMILY_TARGETS.get(fam.get("name"), TARGETS)
    path.write_text(CONFIG.format(run=run, hf=fam["hf"], init=init or fam["init"], targets=", ".join(targets),
                                  lr=LR, wd=WD, data=fam["tokens"], seq=SEQ, micro=MICRO, steps=steps, seed=SEED)
                    + extra)
    return path


def batches(tokens, steps):
    tok = np.fromfile(tokens, dtype="<u2").astype(np.int64)
    for step in range(steps):
        starts = train_window_starts(len(tok), SEED, step, MICRO, SEQ)
        yield (torch.tensor(np.stack([tok[s:s + SEQ] for s in starts])),
               torch.tensor(np.stack([tok[s + 1:s + SEQ + 1] for s in starts])))


def peft_train(model, tokens, steps):
    """torch AdamW over the trainable parameters, the trainer's loss: the mean next-token cross-entropy."""
    model.train()  # (bitsandbytes' CPU Linear4bit takes an inference-only path in eval mode)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=WD)
    losses = []
    for x, y in batches(tokens, steps):
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def randomise(model):
    with torch.no_grad():  # norms' gains around 1, everything else small and random: a misplaced one shows
        for n, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if n.endswith("norm.weight") else 0.15 * torch.randn_like(p))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, tiny_tokens):
    """The family's base (save_pretrained), peft's starting adapter (B non-zero) and its 20 steps."""
    name = request.param
    d = tmp_path_factory.mktemp(f"lora_{name}")
    torch.manual_seed(3)
    base = FAMILIES[name]().float()
    randomise(base)
    base.save_pretrained(d / "hf")
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=FAMILY_TARGETS.get(name, TARGETS),
                                                      lora_dropout=0.0, fan_in_fan_out=name == "gpt2"))
    with torch.no_grad():  # B = 0 (peft's init) would hide a misplaced B: start from a random one
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(d / "init")
    start = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    losses = peft_train(model, tiny_tokens, STEPS)
    final = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    return {"name": name, "dir": d, "hf": d / "hf", "init": d / "init", "tokens": tiny_tokens, "losses": losses,
            "start": start, "final": final}


@pytest.fixture(scope="module")
def one(family):
    """nnstrain on one process from peft's folders; its checkpoint's --adapter and --hf merges."""
    d = family["dir"] / "one"
    cfg = config_file(family["dir"] / "one.yaml", family, d)
    p = nnstrain("--config", cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    ck = d / "ck" / f"step-{STEPS:08d}"
    for flag, out in (("--adapter", d / "adapter"), ("--hf", d / "merged")):
        m = nnstrain("merge", ck, "--out", out, flag)
        assert m.returncode == 0, m.stdout + m.stderr
    train, _ = read_metrics(d / "metrics.jsonl")
    return {"dir": d, "cfg": cfg, "ck": ck, "losses": {r["step"]: r["loss"] for r in train}, "output": p.stdout + p.stderr}


def test_losses_and_adapters_equal_peft(family, one):
    want = family["losses"]
    got = one["losses"]
    assert sorted(got) == list(range(1, STEPS + 1)), got
    worst = max(rel(got[s + 1], want[s]) for s in range(STEPS))
    print(f"{family['name']}: worst loss difference to peft over {STEPS} steps: {worst:.2e}; "
          f"loss {want[0]:.4f} -> {want[-1]:.4f}")
    assert sum(want[-5:]) < sum(want[:5]) - 0.1, want  # it learned: the comparison is of a moving run
    assert worst <= 1e-5, (got, want)
    from safetensors.torch import load_file
    ours = load_file(one["dir"] / "adapter" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(family["final"]), sorted(set(ours) ^ set(family["final"]))
    assert len(ours) == 2 * 3 * len(FAMILY_TARGETS.get(family["name"], TARGETS)) + (6 if family["name"] == "gpt2" else 0)
    diff = max((ours[k] - family["final"][k]).abs().max().item() for k in ours)
    print(f"{family['name']}: final adapters' largest difference to peft: {diff:.2e} over {len(ours)} tensors")
    moved = max((family["final"][k] - family["start"][k]).abs().max().item() for k in ours)
    assert diff <= 1e-5 and moved > 1e-2, (diff, moved)
    cfg = json.loads((one["dir"] / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and cfg["peft_type"] == "LORA", cfg


def test_peft_loads_the_adapter_with_merged_logits(family, one):
    """PeftModel.from_pretrained(base, --adapter) == transformers on --hf (W + scale B A), within 1e-5."""
    base = transformers.AutoModelForCausalLM.from_pretrained(family["hf"]).float().eval()
    model = peft.PeftModel.from_pretrained(base, one["dir"] / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(one["dir"] / "merged").float().eval()
    x, _ = next(batches(family["tokens"], 1))
    with torch.no_grad():
        a, b = model(input_ids=x).logits, merged(input_ids=x).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(family["hf"]).float().eval()(input_ids=x).logits
    diff = (a - b).abs().max().item()
    print(f"{family['name']}: peft-loaded vs merged logits: {diff:.2e}")
    assert diff <= 1e-5, diff
    assert (a - plain).abs().max().item() > 1e-2  # the adapters changed the model


def test_plans_equal_one_process(family, one):
    """dp 2 ZeRO-3, tp 2, pp 2, cp 2: one process's losses within 1e-5; the records show adapters alone."""
    if family["name"] == "qwen2":
        pytest.skip("the plans run on the Llama (the same decoder); qwen2 checks peft parity")
    plans = PLANS if family["name"] == "llama" else {"tp2": PLANS["tp2"]}  # GPT-2: c_attn's fused q/k/v split in parts
    for plan, (ranks, overrides) in plans.items():
        d = family["dir"] / plan
        cfg = config_file(family["dir"] / f"{plan}.yaml", family, d)
        got = run_ranks(ranks, d, ["--config", str(cfg), *overrides], overrides)
        worst = max(rel(got[s][0], one["losses"][s]) for s in one["losses"])
        print(f"{plan}: worst loss difference to one process: {worst:.2e}")
        assert worst <= 1e-5, (plan, got, one["losses"])
        held = held_between_steps(d, ranks)
        for rank, rec in active_records(d, ranks).items():
            lo = rec["lora"]
            assert lo and lo["state_others"] == [] and lo["state_adapter_params"] > 0, (plan, rank, lo)
            # The state (gradients, masters, moments) covers this rank's adapter elements and nothing else.
            assert held[rank]["elements"] == lo["adapter_elements"], (plan, rank, held[rank], lo)
            assert lo["frozen_requiring_grad"] == 0 and lo["frozen_tensors"] > 0, (plan, rank, lo)
            fz = rec["first_step"]["lora_frozen"]
            assert fz["with_grad"] == 0 and fz["requiring_grad"] == 0, (plan, rank, fz)
            # ZeRO-3 shards the frozen base: this rank keeps half of it (the whole padded to
            # 16-byte pieces), gathers the rest for compute; other plans hold their base whole.
            z3 = lo["zero3_frozen"]
            if plan.startswith("zero3"):
                assert z3["whole_bytes"] >= lo["frozen_bytes"] > 0 and z3["held_bytes"] * 2 == z3["whole_bytes"], (rank, z3, lo)
                # padding: under 16 bytes a tensor, under 2 x 16 a unit (each unit has a tensor)
                assert z3["whole_bytes"] - lo["frozen_bytes"] < 48 * lo["frozen_tensors"], (rank, z3, lo)
            else:
                assert z3 == {"held_bytes": 0, "whole_bytes": 0}, (plan, rank, z3)
        check_planner(cfg, ranks, overrides, d, plan)


def check_planner(cfg, ranks, overrides, run_dir, plan):
    """`nnstrain plan` for the run's config and world prices what the run held: the frozen base
    (the converter's bytes, from the record) and the training state (the log's bytes held between
    steps) of one of its ranks, the adapters alone."""
    p = nnstrain("plan", "--config", cfg, "--runtime-ngpus", ranks, "--json", *overrides)
    assert p.returncode == 0, p.stdout + p.stderr
    est = json.loads(p.stdout)["plan"]["estimate"]
    recs = active_records(run_dir, ranks)
    held = held_between_steps(run_dir, ranks)
    # The frozen base as held between steps: ZeRO-3's chunks where it shards it.
    ran = [(recs[r]["lora"]["zero3_frozen"]["held_bytes"] or recs[r]["lora"]["frozen_bytes"], held[r]["param"] + held[r]["grad"] + held[r]["master"] + held[r]["moments"],
            recs[r]["lora"]["state_adapter_params"]) for r in recs]
    state = est["param_bytes"] + est["grad_bytes"] + est["optim_bytes"]
    print(f"{plan}: planner frozen {est['frozen_bytes']:.0f} B, state {state:.0f} B; ranks (frozen, state): {ran}")
    # The estimate is one rank's (the largest's): its frozen base exactly, its state within the
    # flat layout's padding (under 16 elements a tensor, 16 bytes an element at 32-true with AdamW).
    assert any(est["frozen_bytes"] == f and abs(state - h) <= 16 * 16 * n for f, h, n in ran), (plan, est, ran)


def test_resume_refuses_another_base(family, one, tmp_path):
    if family["name"] != "llama":
        pytest.skip("one family suffices")
    other = tmp_path / "other"
    torch.manual_seed(5)
    m = FAMILIES["llama"]().float()
    m.save_pretrained(other, max_shard_size="20KB")  # a sharded folder: its index names other files
    fam = {**family, "hf": other}
    cfg = config_file(tmp_path / "r.yaml", fam, tmp_path / "run", steps=STEPS + 2)
    p = nnstrain("--config", cfg, "--resume", one["ck"])
    assert p.returncode == 2 and "model.init_from" in p.stderr and "SHA-256" in p.stderr, p.stdout + p.stderr
    # The same base resumes.
    cfg = config_file(tmp_path / "s.yaml", family, tmp_path / "run2", steps=STEPS + 2)
    p = nnstrain("--config", cfg, "--resume", one["ck"])
    assert p.returncode == 0, p.stdout + p.stderr


def test_bad_targets_exit_2_naming_them(family, tmp_path):
    if family["name"] != "llama":
        pytest.skip("one family suffices")
    cfg = config_file(tmp_path / "c.yaml", family, tmp_path / "run", steps=1, targets=["q_proj", "qkv_proj"])
    p = nnstrain("--config", cfg)
    assert p.returncode == 2 and "lora.target_modules" in p.stderr and "'qkv_proj'" in p.stderr, p.stderr
    for key, value, named in (("--lora.r", "0", "lora.r"), ("--lora.bias", "all", "lora.bias"),
                              ("--lora.init", "pissa", "lora.init"), ("--lora.double_quant", "true", "double_quant"),
                              ("--lora.init_from", str(tmp_path), "lora.init_from")):
        p = nnstrain("--config", config_file(tmp_path / "c.yaml", family, tmp_path / "run", steps=1), key, value)
        assert p.returncode == 2 and named in p.stderr, (key, p.stderr)
    p = nnstrain("--config", config_file(tmp_path / "c.yaml", family, tmp_path / "run", steps=1), "--lora.alpha", "8")
    assert p.returncode == 2 and "lora_alpha" in p.stderr, p.stderr  # the peft folder says 16
    # Stacked MoE experts are not linear layers: naming them (or peft's target_parameters) is refused precisely.
    moe = ["--config", str(SOURCE / "tests/integration/configs/tiny_moe.yaml"), "--vars.data", str(family["tokens"]),
           "--run_dir", str(tmp_path / "moe"), "--max_train_steps", "1", "--compute_config.device", "cpu", "--lora.r", "4"]
    p = nnstrain(*moe, "--lora.target_modules", "[q_proj, model.layers.1.mlp.experts]")
    assert p.returncode == 2 and "'model.layers.1.mlp.experts' names stacked MoE experts" in p.stderr, p.stderr
    p = nnstrain(*moe, "--lora.target_modules", "[q_proj]", "--lora.target_parameters", "[experts]")
    assert p.returncode == 2 and "lora.target_parameters" in p.stderr and "not offered" in p.stderr, p.stderr


QSTEPS = 10
# bitsandbytes' native CPU dequantization is its Python reference's only when a row is whole
# 64-element blocks (measured: a [48, 48] weight dequantizes 0.16 away from code x absmax), so
# its reference model has widths of whole blocks: 64, 192.
QLORA_MODEL = dict(COMMON, vocab_size=67, hidden_size=64, intermediate_size=192, num_attention_heads=4,
                   num_key_value_heads=2)


def test_qlora_equals_peft_with_bitsandbytes(tmp_path, tiny_tokens):
    """NF4 base (double quantization) + adapters: peft over bitsandbytes' Linear4bit on the CPU, 10 steps."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(4)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**QLORA_MODEL)).float()
    randomise(base)
    base.save_pretrained(tmp_path / "hf")
    full = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for n, p in full.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn_like(p))
    full.save_pretrained(tmp_path / "init")
    float_losses = peft_train(full, tiny_tokens, 1)
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                        bnb_4bit_compute_dtype=torch.float32)
    base4 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", quantization_config=q, device_map="cpu",
                                                              dtype=torch.float32)
    assert type(base4.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    model = peft.PeftModel.from_pretrained(base4, tmp_path / "init", is_trainable=True)
    want = peft_train(model, tiny_tokens, QSTEPS)
    fam = {"hf": tmp_path / "hf", "init": tmp_path / "init", "tokens": tiny_tokens}
    cfg = config_file(tmp_path / "q.yaml", fam, tmp_path / "run", steps=QSTEPS)
    p = nnstrain("--config", cfg, "--lora.base_quantization", "nf4", "--lora.double_quant", "true")
    assert p.returncode == 0, p.stdout + p.stderr
    train, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    got = [r["loss"] for r in train]
    rec = active_records(tmp_path / "run", 1)[0]["lora"]
    assert rec["quantized_layers"] == 3 * len(TARGETS), rec
    worst = max(rel(g, w) for g, w in zip(got, want))
    print(f"QLoRA vs peft + bitsandbytes: worst loss difference {worst:.2e} over {QSTEPS} steps; "
          f"loss {want[0]:.4f} -> {want[-1]:.4f} (fp32 base: {float_losses[0]:.4f}); frozen base {rec['frozen_bytes']} bytes")
    assert len(got) == QSTEPS and worst <= 1e-5, (got, want)
    assert sum(got[-3:]) < sum(got[:3]), got  # a falling curve
    # Backward dequantizes again (LoraAdapter::linear): the forward keeps no dequantized weight, so
    # QLoRA's activations are LoRA's (same model and batch), not LoRA's plus the adapted weights.
    p = nnstrain("--config", config_file(tmp_path / "l.yaml", fam, tmp_path / "lora", steps=2))
    assert p.returncode == 0, p.stdout + p.stderr
    act = {name: max(r["activation_mb"] for r in read_metrics(tmp_path / name / "metrics.jsonl")[0] if "activation_mb" in r)
           for name in ("run", "lora")}
    h, f, kv = QLORA_MODEL["hidden_size"], QLORA_MODEL["intermediate_size"], QLORA_MODEL["num_key_value_heads"]
    kv_width = kv * h // QLORA_MODEL["num_attention_heads"]
    per_layer = 2 * h * h + 2 * kv_width * h + 3 * f * h  # q, o; k, v; gate, up, down
    dequantized = QLORA_MODEL["num_hidden_layers"] * per_layer * 4 / 2**20  # fp32
    print(f"activations: QLoRA {act['run']:.3f} MiB, LoRA {act['lora']:.3f} MiB; the adapted weights {dequantized:.3f} MiB")
    assert act["run"] - act["lora"] < 0.25 * dequantized, (act, dequantized)
    assert abs(got[0] - float_losses[0]) > 1e-4, (got[0], float_losses[0])  # the NF4 base is not the float one


def test_generate_on_the_checkpoint_equals_peft(family, one):
    """`nnstrain generate CKPT` of a LoRA run: greedy tokens are peft's generate(do_sample=False) on --adapter."""
    base = transformers.AutoModelForCausalLM.from_pretrained(family["hf"]).float().eval()
    x, _ = next(batches(family["tokens"], 1))
    prompt = x[:1, :8]
    new = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        plain = base.generate(prompt, **new)[0, 8:].tolist()
        model = peft.PeftModel.from_pretrained(base, one["dir"] / "adapter").eval()
        want = model.generate(input_ids=prompt, **new)[0, 8:].tolist()
    assert want != plain, "the adapters do not change greedy decoding here: the test would prove nothing"
    p = nnstrain("generate", one["ck"], "--prompt-ids", ",".join(map(str, prompt[0].tolist())), "--temperature", 0,
                 "--max-new-tokens", 16, "--json", "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    (s,) = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert s["ids"] == want, f"nnstrain {s['ids']}\npeft {want}\nbase {plain}"


def test_dropout_under_tp_equals_one_process(family, one, tmp_path):
    """lora.dropout 0.1: tp 2 (with and without sequence parallelism) draws one process's masks, within 1e-5."""
    if family["name"] != "llama":
        pytest.skip("one family suffices")
    drop = ["--lora.dropout", "0.1"]
    cfg = config_file(tmp_path / "d.yaml", family, tmp_path / "one", steps=4)
    p = nnstrain("--config", cfg, *drop)
    assert p.returncode == 0, p.stdout + p.stderr
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "one" / "metrics.jsonl")[0]}
    assert max(rel(want[s], one["losses"][s]) for s in want) > 1e-4, "dropout changed nothing: it did not run"
    for name, extra in (("tp2_sp", []), ("tp2", ["--compute_config.sequence_parallel", "false"])):
        ranks, plan = PLANS["tp2"]
        d, overrides = tmp_path / name, [*plan, *extra]
        cfg = config_file(tmp_path / f"{name}.yaml", family, d, steps=4)
        got = run_ranks(ranks, d, ["--config", str(cfg), *drop, *overrides], overrides)
        worst = max(rel(got[s][0], want[s]) for s in want)
        print(f"{name}: dropout 0.1, worst loss difference to one process: {worst:.2e}")
        assert worst <= 1e-5, (name, got, want)


def test_planner_prices_the_frozen_base_and_chooses_with_it(family, one, tmp_path):
    """One process: the plan shows what trains and the frozen base (--explain); a budget the
    LoRA run fits in and full training of the same model does not: the first plans, the second
    is refused, naming the budget."""
    if family["name"] != "llama":
        pytest.skip("one family suffices")
    check_planner(one["cfg"], 1, [], one["dir"], "one")
    p = nnstrain("plan", "--config", one["cfg"], "--explain")
    assert p.returncode == 0, p.stderr
    assert "trains: lora r 8 on 21 linear layers" in p.stdout and "frozen base" in p.stdout, p.stdout
    est = json.loads(nnstrain("plan", "--config", one["cfg"], "--json").stdout)["plan"]["estimate"]
    full_cfg = tmp_path / "full.yaml"
    text = one["cfg"].read_text()
    full_cfg.write_text(text[:text.index("lora:")] + text[text.index("optimizer:"):])
    full = nnstrain("plan", "--config", full_cfg, "--json")
    assert full.returncode == 0, full.stderr
    full_est = json.loads(full.stdout)["plan"]["estimate"]
    assert est["total_bytes"] < full_est["total_bytes"], (est, full_est)
    # Frozen weights skip their weight gradients: less compute than full training's.
    assert est["compute_s"] < full_est["compute_s"], (est, full_est)
    # Between the two: LoRA's plan stays as it is, full training's must recompute activations to fit.
    budget = str((est["total_bytes"] + full_est["total_bytes"]) / 2 / 2**30)
    plans = {}
    for name, cfg in (("lora", one["cfg"]), ("full", full_cfg)):
        p = nnstrain("plan", "--config", cfg, "--memory-budget-gb", budget, "--json")
        assert p.returncode == 0, p.stdout + p.stderr
        plans[name] = json.loads(p.stdout)["plan"]
    assert not any(plans["lora"]["recompute"]) and any(plans["full"]["recompute"]), plans
