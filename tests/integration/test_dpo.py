"""Preference alignment (issue 54) against TRL: nnstrain's `alignment:` section on pairs
`prepare corpus --format preference` stored, and the reference library on the same pairs.

- sigmoid, ipo, hinge: TRL's DPOTrainer itself (the same text pairs, tokenized by TRL, in the
  file's order, one batch per step, torch AdamW, no clipping), with a frozen reference and with
  precomputed reference log-probabilities: every step's loss and TRL's eight metrics
  (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
  logps/rejected, logits/chosen, logits/rejected) within 1e-5 relative.
- simpo, orpo: CPOTrainer's and ORPOTrainer's loss functions (trl.experimental) on the
  per-token averages their get_batch_logps computes, in a plain torch loop over the same
  batches (their trainers tokenize on their own, with BOS and EOS rules of their own).
- dp 2 under ZeRO-3 (precomputed), tp 2 (frozen), cp 2 (frozen, precomputed) and pp 2
  (precomputed: the last stage reads each micro-batch's row of the table) equal one process; the run's record shows the plan, the loss type and the reference that ran; a run
  resumed under tp 2 equals the uninterrupted one, and its checkpoint merges.
- Bad keys exit 2 naming them.
"""
import json
import math
import pathlib
import subprocess

import numpy as np
import pytest

from chat_common import read_indexed, write_tokenizer
from conftest import SOURCE, active_records, assert_active, nnstrain_bin_path, read_metrics, single_process_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

SEQ, STEPS, PAIRS, LR, BETA = 48, 10, 4, 2e-3, 0.2
METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected"]
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "fish"]


def records(n=24, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b, c = (WORDS[j] for j in rng.choice(len(WORDS), 3, replace=False))
        out.append({"prompt": f"Q{i}: name the {a} and the {b}?",
                    "chosen": f" The {a} and the {b}." + (" Yes." * int(rng.integers(0, 3))),
                    "rejected": f" A {c}{'!' * int(rng.integers(1, 4))}"})
    return out


CONFIG = """
run_dir: {run}
compute_config: {{device: cpu, backend: gloo, collective_timeout_s: 60}}
model:
  init_from: {hf}
alignment:
{alignment}
optimizer:
  type: adamw
  args: {{lr: {lr}, betas: [0.9, 0.999], eps: 1.0e-8, weight_decay: 0.0}}
  clip_gnorm: 0.0
lr_scheduler: {{type: constant}}
dataset:
  type: preference
  train_args: {{path: {data}, seq_len: {seq}, shuffle: false}}
micro_batch_size: {micro}
global_batch_size: {pairs}
max_train_steps: {steps}
log_progress_every_n_train_steps: 1
seed: 7
"""


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-6)


def run(*args, timeout=300):
    return subprocess.run([nnstrain_bin_path(), *map(str, args)], cwd=SOURCE, env=single_process_env(1),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    tok_dir = write_tokenizer(d / "tok", "chatml")
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    recs = records()
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    p = run("prepare", "corpus", "--format", "preference", "--tokenizer", tok_dir, "--input", d / "pairs.jsonl",
            "--out", d / "pref")
    assert p.returncode == 0, p.stderr
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=96,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, q in model.named_parameters():
            q.copy_(1.0 + 0.1 * torch.randn_like(q) if n.endswith("norm.weight") else 0.1 * torch.randn_like(q))
    model.save_pretrained(d / "hf")
    # A second family: Qwen2 (biases on q, k, v), the same widths.
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{k: v for k, v in cfg.to_dict().items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")},
        use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    with torch.no_grad():
        for n, q in qwen.named_parameters():
            q.copy_(1.0 + 0.1 * torch.randn_like(q) if n.endswith("norm.weight") else 0.1 * torch.randn_like(q))
    qwen.save_pretrained(d / "qwen2")
    return {"dir": d, "tok": tok, "records": recs, "hf": d / "hf", "qwen2": d / "qwen2", "data": d / "pref"}


def nnstrain_run(setup, name, alignment, *overrides, ranks=1, micro=PAIRS, steps=STEPS):
    run_dir = setup["dir"] / name
    cfg = setup["dir"] / f"{name}.yaml"
    cfg.write_text(CONFIG.format(run=run_dir, hf=setup["hf"], alignment=alignment, lr=LR, data=setup["data"],
                                 seq=SEQ, micro=micro, pairs=PAIRS, steps=steps))
    args = ["--config", cfg, *overrides]
    cmd = args if ranks == 1 else ["launch", "--nproc-per-node", ranks, "--", *args]
    p = run(*cmd)
    assert p.returncode == 0, p.stdout + p.stderr
    train, _ = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    return train, active_records(run_dir, ranks), p.stdout + p.stderr


def own_table(setup, name, reference):
    """A run's own precomputed table, so each run computes it (test_precomputed_table_is_reused reads one back)."""
    return f"\n  ref_log_probs: {setup['dir'] / (name + '.ref.safetensors')}" if reference == "precomputed" else ""


def trl_dpo(setup, loss_type, precompute, model=None, evaluate=False):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):  # the file's order, as nnstrain's shuffle: false
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    tok = setup["tok"]
    tok.pad_token = tok.eos_token
    peft_model = model is not None  # a peft model: its reference is its base, the adapters disabled
    model = model or transformers.AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    ref = None if precompute or peft_model else transformers.AutoModelForCausalLM.from_pretrained(
        setup["hf"], dtype=torch.float32)
    args = DPOConfig(output_dir=str(setup["dir"] / f"trl_{loss_type}_{precompute}_{peft_model}_{setup['hf'].name}"), per_device_train_batch_size=PAIRS,
                     max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=0.0, logging_steps=1,
                     report_to=[], save_strategy="no", loss_type=[loss_type], beta=BETA, max_length=SEQ,
                     precompute_ref_log_probs=precompute, use_cpu=True, seed=7, dataloader_num_workers=0,
                     per_device_eval_batch_size=PAIRS, eval_strategy="no",
                     bf16=False)  # DPOConfig defaults to bf16 autocast, the CPU included
    t = InOrder(model=model, ref_model=ref, args=args, processing_class=tok,
                train_dataset=Dataset.from_list(setup["records"]),
                eval_dataset=Dataset.from_list(setup["records"][:PAIRS]) if evaluate else None)
    t.train()
    if evaluate:
        return t.evaluate()
    logs = [h for h in t.state.log_history if "loss" in h and "step" in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    return logs


def compare(ours, theirs, keys, tol=1e-5, beta=BETA):
    """Relative differences, each against the magnitude it is computed from: a reward or margin is
    beta x a difference of two summed log-probabilities, so its rounding is that of beta x the sums;
    logits/* is a mean of logits of either sign (this model's are of order 0.1-1), so against at least 0.1."""
    worst = {}
    for o, t in zip(ours, theirs):
        for k in keys:
            scale = abs(t[k])
            if k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
                scale = max(scale, beta * abs(t["logps/chosen"]), beta * abs(t["logps/rejected"]))
            if k.startswith("logits/"):  # a mean over the vocabulary of logits of either sign cancels toward 0
                scale = max(scale, 0.1)
            d = abs(o[k] - t[k]) / max(scale, 1e-6)
            worst[k] = max(worst.get(k, 0.0), d)
            assert d <= tol, (o["step"], k, o[k], t[k])
    return worst


@pytest.mark.parametrize("loss_type,reference,family", [
    ("sigmoid", "frozen", "hf"), ("sigmoid", "precomputed", "hf"), ("ipo", "frozen", "hf"),
    ("ipo", "precomputed", "hf"), ("hinge", "frozen", "hf"), ("hinge", "precomputed", "hf"),
    ("sigmoid", "frozen", "qwen2")])
def test_dpo_equals_trl(setup, loss_type, reference, family):
    setup = dict(setup, hf=setup[family])
    theirs = trl_dpo(setup, loss_type, reference == "precomputed")
    ours, rec, out = nnstrain_run(setup, f"{loss_type}_{reference}_{family}",
                                  f"  loss_type: {loss_type}\n  beta: {BETA}\n  reference: {reference}" +
                                  own_table(setup, f"{loss_type}_{reference}_{family}", reference))
    ran = rec[0]["first_step"]["alignment"]
    assert ran["loss_type"] == loss_type and ran["reference"] == reference and ran["policy_forwards"] == 1
    assert ran["reference_forwards"] == (1 if reference == "frozen" else math.ceil(len(setup["records"]) / PAIRS))
    # The comparison means something: the policy moved away from the reference.
    assert abs(ours[-1]["rewards/margins"]) > 1e-3 and ours[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    worst = compare(ours, theirs, ["loss"] + METRICS)
    print(family, loss_type, reference, {k: f"{v:.1e}" for k, v in worst.items()})


def test_lora_adapters_off_equals_trl_with_peft(setup):
    """LoRA's base as the reference (adapters switched off, no copy): TRL's DPOTrainer on the same
    fresh peft adapter (A random, B zero: the start is the base), ref_model None. A starting adapter
    whose B is not zero is not its base: adapters_off is refused for it, naming the key."""
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj", "down_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    torch.manual_seed(1)
    start = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    start.save_pretrained(setup["dir"] / "adapter")
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32), setup["dir"] / "adapter",
        is_trainable=True)
    theirs = trl_dpo(setup, "sigmoid", False, model=model)
    lora = (f"\nlora: {{r: 4, alpha: 8, dropout: 0.0, target_modules: [{', '.join(targets)}], "
            "init_from: ADAPTER}")
    ours, rec, _ = nnstrain_run(setup, "lora_off",
                                f"  loss_type: sigmoid\n  beta: {BETA}" + lora.replace("ADAPTER", str(setup["dir"] / "adapter")))
    ran = rec[0]["first_step"]["alignment"]
    assert ran["reference"] == "adapters_off" and ran["reference_forwards"] == 1, ran  # auto under lora
    assert abs(ours[-1]["rewards/margins"]) > 1e-3  # the adapters moved the policy off its base
    worst = compare(ours, theirs, ["loss"] + METRICS)
    print("lora adapters_off", {k: f"{v:.1e}" for k, v in worst.items()})

    with torch.no_grad():
        for n, q in start.named_parameters():
            if "lora_B" in n:
                q.normal_(0, 0.05)
    start.save_pretrained(setup["dir"] / "adapter_b")
    cfg = setup["dir"] / "lora_b.yaml"
    cfg.write_text(CONFIG.format(run=setup["dir"] / "lora_b", hf=setup["hf"], lr=LR, data=setup["data"], seq=SEQ,
                                 micro=PAIRS, pairs=PAIRS, steps=1,
                                 alignment="  loss_type: sigmoid" + lora.replace("ADAPTER", str(setup["dir"] / "adapter_b"))))
    p = run("--config", cfg)
    assert p.returncode == 2 and "alignment.reference" in p.stderr and "precomputed" in p.stderr, p.stderr


def trl_formula_loop(setup, loss_type):
    """simpo / orpo: TRL's loss functions over the pairs nnstrain stored, torch AdamW, one batch per step."""
    from types import SimpleNamespace
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer
    docs = read_indexed(setup["data"])
    model = transformers.AutoModelForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    me = SimpleNamespace(beta=BETA, simpo_gamma=0.5, label_smoothing=0.0, alpha=0.0, loss_type="simpo",
                         accelerator=SimpleNamespace(device=torch.device("cpu")))
    out = []
    for step in range(STEPS):
        pairs = [docs[(step * PAIRS + i) % len(docs)] for i in range(PAIRS)]
        rows = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
        labels = [[-100] * len(p) + c for p, c, _ in pairs] + [[-100] * len(p) + r for p, _, r in pairs]
        L = max(map(len, rows))
        x = torch.tensor([r + [0] * (L - len(r)) for r in rows])
        y = torch.tensor([r + [-100] * (L - len(r)) for r in labels])
        logits = model(input_ids=x).logits
        avg = CPOTrainer.get_batch_logps(logits, y, average_log_prob=True)
        c, r = avg[:PAIRS], avg[PAIRS:]
        if loss_type == "simpo":
            losses, cr, rr = CPOTrainer.cpo_loss(me, c, r)
            loss = losses.mean()
        else:
            losses, cr, rr, _, _ = ORPOTrainer.odds_ratio_loss(me, c, r)
            nll = torch.nn.functional.cross_entropy(logits[:PAIRS, :-1].reshape(-1, logits.size(-1)),
                                                    y[:PAIRS, 1:].reshape(-1))
            loss = nll - losses.mean()
        out.append({"step": step + 1, "loss": loss.item(), "rewards/chosen": cr.mean().item(),
                    "rewards/rejected": rr.mean().item(), "rewards/accuracies": (cr > rr).float().mean().item(),
                    "rewards/margins": (cr - rr).mean().item(), "logps/chosen": c.mean().item(),
                    "logps/rejected": r.mean().item()})
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_equal_trls(setup, loss_type):
    theirs = trl_formula_loop(setup, loss_type)
    ours, rec, _ = nnstrain_run(setup, loss_type, f"  loss_type: {loss_type}\n  beta: {BETA}")
    assert rec[0]["first_step"]["alignment"]["reference_forwards"] == 0
    worst = compare(ours, theirs, ["loss"] + METRICS[:6])
    print(loss_type, {k: f"{v:.1e}" for k, v in worst.items()})


PLANS = {
    "zero3_dp2": (2, "precomputed", ["--micro_batch_size", "2", "--compute_config.use_zero", "3"]),
    "tp2": (2, "frozen", ["--compute_config.plan_ngpus", "2", "--pas_policy", "tp"]),
    "cp2": (2, "frozen", ["--compute_config.context_parallel_size", "2"]),
    "cp2_precomputed": (2, "precomputed", ["--compute_config.context_parallel_size", "2"]),
    "pp2_precomputed": (2, "precomputed", ["--compute_config.pas_config.pp_size", "2", "--micro_batch_size", "2",
                                           "--grad_accumulation_steps", "2"]),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_plans_equal_one_process(setup, plan):
    ranks, reference, overrides = PLANS[plan]
    alignment = f"  loss_type: sigmoid\n  beta: {BETA}\n  reference: {reference}"
    one, _, _ = nnstrain_run(setup, f"one_{reference}", alignment + own_table(setup, f"one_{plan}", reference))
    many, rec, out = nnstrain_run(setup, plan, alignment + own_table(setup, plan, reference), *overrides, ranks=ranks)
    ran = [r["first_step"]["alignment"] for r in rec.values()]
    assert all(x["reference"] == reference for x in ran), ran
    assert max(x["reference_forwards"] for x in ran) > 0, ran  # under pp: the last stage's ranks
    assert_active(setup["dir"] / plan, out, ranks, overrides)  # the plan compared really ran
    compare(many, one, ["loss"] + METRICS)


def test_precomputed_table_is_reused(setup):
    """The default table beside the dataset: computed once, read back by the next run of the same
    reference (no reference forward), refused when it belongs to another, and when a resumed run lacks it."""
    alignment = f"  loss_type: sigmoid\n  beta: {BETA}\n  reference: precomputed"
    for t in setup["data"].parent.glob("pref.ref_logps-*.safetensors"):
        t.unlink()
    first, rec1, _ = nnstrain_run(setup, "table_first", alignment, steps=2)
    tables = list(setup["data"].parent.glob("pref.ref_logps-*.safetensors"))
    assert len(tables) == 1 and rec1[0]["first_step"]["alignment"]["reference_forwards"] > 0
    again, rec2, out = nnstrain_run(setup, "table_again", alignment, steps=2)
    assert rec2[0]["first_step"]["alignment"]["reference_forwards"] == 0 and "read from" in out
    assert [r["loss"] for r in again] == [r["loss"] for r in first]
    other = setup["dir"] / "other.safetensors"
    other.write_bytes(tables[0].read_bytes())
    cfg = setup["dir"] / "table_again.yaml"
    p = run("--config", cfg, "--alignment.ref_log_probs", other, "--dataset.train_args.seq_len", "40")
    assert p.returncode == 2 and "alignment.ref_log_probs" in p.stderr and "another" in p.stderr, p.stderr


@pytest.mark.parametrize("key,value,needle", [
    ("beta", "0", "alignment.beta"),
    ("loss_type", "kto", "alignment.loss_type"),
    ("reference", "adapters_off", "alignment.reference"),
])
def test_bad_alignment_keys_exit_2(setup, key, value, needle):
    run_dir = setup["dir"] / f"bad_{key}"
    cfg = setup["dir"] / f"bad_{key}.yaml"
    cfg.write_text(CONFIG.format(run=run_dir, hf=setup["hf"], alignment="  loss_type: sigmoid", lr=LR,
                                 data=setup["data"], seq=SEQ, micro=PAIRS, pairs=PAIRS, steps=1))
    p = run("--config", cfg, f"--alignment.{key}", value)
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_pipeline_refuses_a_reference_forward_naming_the_key(setup):
    run_dir = setup["dir"] / "pp"
    cfg = setup["dir"] / "pp.yaml"
    cfg.write_text(CONFIG.format(run=run_dir, hf=setup["hf"], alignment="  loss_type: sigmoid", lr=LR,
                                 data=setup["data"], seq=SEQ, micro=2, pairs=PAIRS, steps=1))
    p = run("launch", "--nproc-per-node", 2, "--", "--config", cfg, "--compute_config.pas_config.pp_size", "2",
            "--grad_accumulation_steps", "2")
    assert p.returncode == 2 and "alignment.reference" in p.stderr and "pp_size" in p.stderr, p.stderr


def test_resume_under_another_plan_equals_the_uninterrupted_run(setup):
    """5 steps on one process, a checkpoint, the other 5 resumed under tp 2 (the frozen reference
    built again from the starting model): steps 6-10 equal the uninterrupted run's."""
    alignment = f"  loss_type: sigmoid\n  beta: {BETA}\n  reference: frozen"
    whole, _, _ = nnstrain_run(setup, "resume_whole", alignment)
    ck = setup["dir"] / "resume_ck"
    first, _, _ = nnstrain_run(setup, "resume_first", alignment, "--checkpoint.save_dir", ck, steps=5)
    run_dir = setup["dir"] / "resume_first"
    p = run("launch", "--nproc-per-node", 2, "--", "--config", setup["dir"] / "resume_first.yaml",
            "--max_train_steps", STEPS, "--resume", ck / "step-00000005", "--compute_config.plan_ngpus", 2,
            "--pas_policy", "tp")
    assert p.returncode == 0, p.stdout + p.stderr
    train, _ = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(r["groups"]["tp"]["size"] == 2 for r in active_records(run_dir, 2).values())
    compare(train[5:], whole[5:], ["loss"] + METRICS)
    p = run("merge", ck / "step-00000005", "--out", setup["dir"] / "resume_merged", "--hf")  # its saved config loads
    assert p.returncode == 0, p.stderr


def test_frozen_reference_under_zero3_is_refused(setup):
    """A frozen copy under ZeRO-3 would be whole on every rank: exit 2 naming the key, before any step."""
    cfg = setup["dir"] / "z3.yaml"
    cfg.write_text(CONFIG.format(run=setup["dir"] / "z3", hf=setup["hf"], lr=LR, data=setup["data"], seq=SEQ,
                                 micro=2, pairs=PAIRS, steps=1, alignment="  loss_type: sigmoid\n  reference: frozen"))
    p = run("launch", "--nproc-per-node", 2, "--", "--config", cfg, "--compute_config.use_zero", "3")
    assert p.returncode == 2 and "alignment.reference" in p.stderr and "precomputed" in p.stderr, p.stderr


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_label_smoothing_is_the_conservative_loss(setup, loss_type):
    """label_smoothing eps (TRL 1.16 keeps it on CPOTrainer's sigmoid and simpo, not on DPOTrainer's
    sigmoid): with one pair per step, each step's loss is -(1-eps) log s(z) - eps log s(-z) of that
    pair's z, which the logged margin gives (z = margin; simpo: z = margin - gamma)."""
    eps, gamma = 0.2, 0.5
    steps, _, _ = nnstrain_run(setup, f"smooth_{loss_type}", f"  loss_type: {loss_type}\n  beta: {BETA}\n"
                               f"  label_smoothing: {eps}", "--global_batch_size", 1, micro=1, steps=4)
    logsig = lambda z: -math.log1p(math.exp(-z))
    for r in steps:
        z = r["rewards/margins"] - (gamma if loss_type == "simpo" else 0.0)
        want = -(1 - eps) * logsig(z) - eps * logsig(-z)
        assert rel(r["loss"], want) < 1e-5, (r["step"], r["loss"], want)
    assert any(abs(r["rewards/margins"]) > 1e-3 for r in steps)  # z moved off 0, where eps would not show


def test_planner_counts_the_frozen_copy(setup):
    """nnstrain plan: a frozen reference holds a second copy of the weights (none of its own gradients
    or moments); precomputed none; a preference micro-batch is two rows per pair."""
    cfg = setup["dir"] / "plan.yaml"
    cfg.write_text(CONFIG.format(run=setup["dir"] / "plan", hf=setup["hf"], lr=LR, data=setup["data"], seq=SEQ,
                                 micro=PAIRS, pairs=PAIRS, steps=1, alignment="  loss_type: sigmoid"))
    est = {}
    for ref in ("frozen", "precomputed"):
        p = run("plan", "--config", cfg, "--json", "--alignment.reference", ref)
        assert p.returncode == 0, p.stderr
        est[ref] = json.loads(p.stdout)["plan"]["estimate"]
    assert est["frozen"]["param_bytes"] == 2 * est["precomputed"]["param_bytes"] > 0
    assert est["frozen"]["grad_bytes"] == est["precomputed"]["grad_bytes"]
    assert est["frozen"]["optim_bytes"] == est["precomputed"]["optim_bytes"]
    # Its no-grad forward per micro-batch: a third of forward + backward more compute.
    assert est["frozen"]["compute_s"] == pytest.approx(est["precomputed"]["compute_s"] * 4 / 3, rel=1e-6)


@pytest.mark.parametrize("reference", ["frozen", "precomputed"])
def test_validation_pairs_equal_trls_evaluate(setup, reference):
    """dataset.val_args of preference pairs: after the 10 steps, val_loss and val_rewards/* equal
    DPOTrainer.evaluate()'s eval_loss and eval_rewards/* on the same pairs (precomputed: its own table)."""
    theirs = trl_dpo(setup, "sigmoid", reference == "precomputed", evaluate=True)
    run_dir = setup["dir"] / f"val_{reference}"
    _, _, _ = nnstrain_run(setup, f"val_{reference}", f"  loss_type: sigmoid\n  beta: {BETA}\n  reference: {reference}" +
                           own_table(setup, f"val_{reference}", reference),
                           "--dataset.val_args.path", setup["data"], "--val_every_n_train_steps", STEPS,
                           "--max_val_steps", 1)
    _, val = read_metrics(run_dir / "metrics.jsonl")
    assert len(val) == 1 and val[0]["step"] == STEPS and val[0]["val_pairs"] == PAIRS, val
    ours = {"step": STEPS, "loss": val[0]["val_loss"], **{k: val[0]["val_" + k] for k in METRICS}}
    ref = {"loss": theirs["eval_loss"], **{k: theirs["eval_" + k] for k in METRICS}}
    assert abs(ours["rewards/margins"]) > 1e-3  # the trained policy is not its reference
    compare([ours], [ref], ["loss"] + METRICS)


@pytest.mark.parametrize("reference", ["frozen", "precomputed"])
def test_packed_pairs_equal_two_rows(setup, reference):
    """pack: true puts each pair's chosen and rejected into one row of 2 x seq_len as two documents
    (attention within each, positions restarting): every step equals the two-row run at seq_len."""
    alignment = f"  loss_type: sigmoid\n  beta: {BETA}\n  reference: {reference}"
    rows, _, _ = nnstrain_run(setup, f"rows_{reference}", alignment + own_table(setup, f"rows_{reference}", reference))
    packed, rec, _ = nnstrain_run(setup, f"packed_{reference}", alignment + own_table(setup, f"packed_{reference}", reference),
                                  "--dataset.train_args.seq_len", 2 * SEQ, "--dataset.train_args.pack", "true")
    assert rec[0]["first_step"]["document_tiles"] > 0  # attention ran within the documents
    compare(packed, rows, ["loss"] + METRICS)
