#!/usr/bin/env python3
"""The GPU battery's benchmarks: nnstrain against PyTorch eager and torch.compile.

Phases (run in the order given, each adds to the same results folder):
  matmul            bf16 8192^3 matrix-product rate (matmul_probe.py): the MFU
                    denominator. Measured first by any benchmark phase of a
                    results folder that lacks it, so MFU always uses a rate
                    measured in the same run.
  shakespeare       nanoGPT's shakespeare_char (configs/shakespeare_char.yaml)
                    timed: nnstrain for --steps steps without evaluation, and
                    reference.py eager and compile on the same shapes and data.
  shakespeare_full  the same config as written: 5000 steps with evaluation;
                    best validation loss and wall time.
  gpt2              GPT-2 124M, block 1024, synthetic uint16 tokens: the largest
                    micro-batch nnstrain fits without recompute (probed from the
                    top), then eager and compile at that batch (halved on OOM).
  muon              Muon + AdamW against AdamW on GPT-2 124M: the optimizer step alone
                    (time_optimizer_ms, bf16 Newton-Schulz), and torch.optim.Muon /
                    AdamW(fused) on the same shapes (bench/optimizer_step_reference.py).
  llama             a Llama 3.2 1B shape at sequence 4096, synthetic uint32
                    tokens, chunked loss; probed and compared like gpt2.
  profile           a profiler trace of gpt2 and llama for nnstrain, eager and
                    compile at one batch; kernel_table.py's tables (the 15 most
                    expensive kernels, time by kind, the attention kernel that ran)
                    in profile/kernels.md.
  cp_ring           one rank's share of ring attention (128K at cp 8, Llama 3 8B
                    heads) against one plain SDPA call (bench/cp_ring.cpp).
  summary           rewrite summary.md from results.json.

For every nnstrain run: ms/step and tokens/s from its metrics.jsonl (records
after the first --drop steps; each record covers the steps since the previous
one and ends with the one host sync of a logging step), its own mfu, the
allocator's peak memory and any step-time split fields it logs (*_ms), and
`nnstrain plan --json` for the same overrides: the planner's estimate against
the measured peak. MFU for nnstrain, eager and compile alike = FLOPs per token
(nnstrain's formula: 6 x matmul parameters + 12 x layers x width x seq) x
tokens/s / the measured matmul rate.

Writes results.json (every number) and summary.md (the table) into --results,
after every measurement, so a phase cut short keeps what it measured.
--smoke: tiny shapes and few steps on the CPU (a check of the plumbing).
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_gpt_cpu import cpu_model, libtorch_version  # noqa: E402  (the CPU benchmark's helpers)
CONFIGS = HERE / "configs"
DATA = ROOT / "runs" / "battery_data"
# shakespeare_char's tokens: the bundle's copy when battery.sh runs one (nothing written into the checkout).
SHAKESPEARE = pathlib.Path(os.environ.get("NNSTRAIN_BATTERY_DATA") or ROOT / "data" / "shakespeare_char")

# Per benchmark: config, timing (steps, logging interval, first steps dropped),
# micro-batch candidates (None: the config's), steps profiled after the timed
# ones for the kernel tables (kernels; issue 37 (b)), caps in seconds for each
# child process, and the smoke-test overrides (tiny shapes on the CPU).
BENCH = {
    "shakespeare": dict(
        config="shakespeare_char.yaml", steps=300, log_every=25, drop=50, batches=None,
        cap_nnstrain=120, cap_eager=120, cap_compile=200,
        smoke=["--model.args.n_layer", "2", "--model.args.n_head", "2", "--model.args.n_embd", "32",
               "--vars.block_size", "32", "--micro_batch_size", "4"],
        smoke_steps=(20, 5, 5)),
    "gpt2": dict(
        config="gpt2_124m.yaml", steps=60, log_every=10, drop=20, batches=[64, 48, 32, 24, 16, 12, 8, 4], kernels=2,
        cap_nnstrain=150, cap_eager=150, cap_compile=240,
        smoke=["--model.args.n_layer", "2", "--model.args.n_head", "2", "--model.args.n_embd", "32",
               "--model.args.vocab_size", "512", "--vars.block_size", "64"],
        smoke_batches=[8, 4], smoke_steps=(12, 4, 4), smoke_vocab=500),
    "llama": dict(
        # No CUDA-graph row: a 1B model's steps are long enough that launch overhead does not
        # show, and the row cost 27-40 s of the one device call (the H100 run of 2026-11-22).
        config="llama3_1b.yaml", steps=25, log_every=5, drop=10, batches=[8, 6, 4, 2, 1], graphs=False, kernels=2,
        cap_nnstrain=180, cap_eager=180, cap_compile=300,
        smoke=["--model.args.num_hidden_layers", "2", "--model.args.hidden_size", "64",
               "--model.args.intermediate_size", "128", "--model.args.num_attention_heads", "4",
               "--model.args.num_key_value_heads", "2", "--model.args.vocab_size", "512",
               "--vars.seq_len", "64", "--model.loss_chunk_size", "32"],
        smoke_batches=[4, 2], smoke_steps=(8, 2, 2), smoke_vocab=512),
}
SYNTHETIC = {  # benchmark -> (folder, numpy dtype, token ids drawn from [0, n))
    "gpt2": ("gpt2", "uint16", 50257),
    "llama": ("llama3", "uint32", 128256),
}


# ---------------------------------------------------------------- small helpers

def log(msg):
    print(f"[driver {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Ctx:
    """Run-wide settings, the results and the time left."""

    def __init__(self, a):
        self.a = a
        self.smoke = a.smoke
        self.device = "cpu" if a.smoke else "cuda"
        self.out = pathlib.Path(a.results).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.time() + a.time_limit if a.time_limit else None
        path = self.out / "results.json"
        self.results = json.loads(path.read_text()) if path.exists() else {"benchmarks": {}}

    def left(self, cap):
        """Seconds a child may run: its cap, bounded by the phase's time limit."""
        if self.deadline is None:
            return cap
        return max(1, min(cap, int(self.deadline - time.time()) - 5))

    def save(self):
        for key in ("tests", "tests_more"):  # written by battery.sh's tests and tests_more phases
            path = self.out / f"{key}.json"
            if path.exists():
                self.results[key] = json.loads(path.read_text())
        phases = self.out / "phases.txt"  # battery.sh: each phase's exit status, time, or why skipped
        if phases.exists():
            self.results["phases"] = phases.read_text().splitlines()
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2) + "\n")
        write_summary(self.results, self.out / "summary.md")


def run_cmd(cmd, logfile, timeout, cwd=ROOT, env=None):
    """Runs cmd with its output in logfile; returns (rc, text). rc 124: timed out."""
    t0 = time.time()
    env = dict(os.environ if env is None else env)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONUNBUFFERED"] = "1"
    with open(logfile, "w") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        try:
            p = subprocess.run(list(map(str, cmd)), cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                               timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
            f.write(f"\n[driver] killed after {timeout} s\n")
        except OSError as e:  # e.g. no nnstrain binary (the build failed)
            rc = 127
            f.write(f"\n[driver] error: cannot run: {e}\n")
    text = pathlib.Path(logfile).read_text(errors="replace")
    log(f"  rc {rc} in {time.time() - t0:.0f} s: {pathlib.Path(logfile).name}")
    return rc, text


def is_oom(rc, text):
    return rc != 0 and rc != 124 and re.search(r"out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY", text,
                                               re.I) is not None


def last_json_line(text):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def tail(text, n=6):
    return "\n".join(text.strip().splitlines()[-n:])


def error_of(rc, text):
    """The line that says what went wrong (not a backtrace), else the output's end."""
    if rc == 124:
        return "timed out"
    for line in text.splitlines():
        if re.search(r"error|Error|exception|Killed", line) and not line.lstrip().startswith("frame #"):
            return line.strip()[:300]
    return tail(text, 3)[:300]


# ---------------------------------------------------------------- environment

# Asked in a child process: a CUDA context held by the driver would take GPU
# memory from the runs it measures.
TORCH_FACTS = """
import json, torch
f = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    f.update(device=torch.cuda.get_device_name(0), device_memory_gb=round(p.total_memory / 2**30, 1),
             sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
print(json.dumps(f))
"""


def environment(a):
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(), "commit": commit(), "smoke": a.smoke,
           "nnstrain": str(a.nnstrain), "libtorch": libtorch_version(a.nnstrain)}
    p = subprocess.run([a.python, "-c", TORCH_FACTS], capture_output=True, text=True, timeout=120)
    env.update(last_json_line(p.stdout) or {"torch": f"unknown ({p.stderr.strip()[-200:]})"})
    if "device" in env:
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            env["nvidia_smi"] = q.stdout.strip()
            env["driver"] = q.stdout.split(",")[0].strip()
        except (OSError, subprocess.SubprocessError) as e:
            env["driver"] = f"unknown ({e})"
    else:
        env.update(device=cpu_model(), driver="none (CPU)")
    return env


def commit():
    """git HEAD (+ -dirty); on the GPU machine (no .git) what fetch_deps.sh recorded."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        pass
    if os.environ.get("NNSTRAIN_COMMIT"):
        return os.environ["NNSTRAIN_COMMIT"]
    recorded = ROOT / ".debs" / "commit.txt"
    if recorded.exists():
        return recorded.read_text().strip() + " (recorded by fetch_deps.sh)"
    return "unknown"


def plan_device_name(env):
    if env.get("driver", "").startswith("none"):
        return "cpu"
    name = env.get("device", "")
    for key in ("H200", "H100"):
        if key in name:
            return key
    if "A100" in name:
        return "A100-80G" if env.get("device_memory_gb", 0) > 50 else "A100-40G"
    return "auto"


# ---------------------------------------------------------------- matmul

def ensure_matmul(ctx):
    if "matmul" in ctx.results:
        return ctx.results["matmul"]
    log("matmul probe")
    cmd = [ctx.a.python, HERE / "matmul_probe.py", "--device", ctx.device]
    if ctx.smoke:
        cmd += ["--size", "512", "--repeats", "3"]
    rc, text = run_cmd(cmd, ctx.out / "matmul.log", ctx.left(120))
    res = last_json_line(text) if rc == 0 else None
    ctx.results["matmul"] = res or {"error": f"rc {rc}: {tail(text, 3)}"}
    ctx.save()
    return ctx.results["matmul"]


# ---------------------------------------------------------------- nnstrain

def resolved_config(ctx, config, overrides):
    """nnstrain's resolved config; without a working binary, the YAML read here."""
    import yaml
    try:
        p = subprocess.run([ctx.a.nnstrain, "--config", config, *overrides, "--print-config"], cwd=ROOT,
                           capture_output=True, text=True)
        if p.returncode == 0:
            return yaml.safe_load(p.stdout)
        why = p.stderr.strip()[-300:]
    except OSError as e:
        why = str(e)
    log(f"nnstrain --print-config failed ({why}): reading {config} here")
    return read_config_here(config, overrides)


def read_config_here(config, overrides):
    """The battery's configs resolved without nnstrain (they set every key the
    references read): --a.b value overrides, then $(vars.X) substitution."""
    import yaml
    cfg = yaml.safe_load(pathlib.Path(config).read_text())
    for key, value in zip(overrides[::2], overrides[1::2]):
        node, parts = cfg, key.lstrip("-").split(".")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = yaml.safe_load(value) if value != "" else ""

    def subst(v):
        if isinstance(v, dict):
            return {k: subst(x) for k, x in v.items()}
        if isinstance(v, list):
            return [subst(x) for x in v]
        if isinstance(v, str):
            m = re.fullmatch(r"\$\(vars\.(\w+)\)", v)
            if m:
                return cfg["vars"][m.group(1)]
            return re.sub(r"\$\(vars\.(\w+)\)", lambda m: str(cfg["vars"][m.group(1)]), v)
        return v

    cfg = subst(cfg)
    cfg["lr_scheduler"]["args"].setdefault("decay_steps", 0)
    cfg.setdefault("seed", 0)
    return cfg


def flops_per_token(cfg):
    """nnstrain's Model::flops_per_token (models/gpt/gpt.cpp, models/llama/llama.cpp)."""
    m, T = cfg["model"]["args"], cfg["dataset"]["train_args"]["seq_len"]
    if cfg["model"]["type"] == "gpt":
        C, L = m["n_embd"], m["n_layer"]
        n = L * 12 * C * C + m["vocab_size"] * C
        return 6 * n + 12.0 * L * C * T
    C, L = m["hidden_size"], m["num_hidden_layers"]
    hd = m.get("head_dim") or C // m["num_attention_heads"]
    q, kv = m["num_attention_heads"] * hd, m["num_key_value_heads"] * hd
    n = L * (C * q * 2 + C * kv * 2 + 3 * C * m["intermediate_size"]) + m["vocab_size"] * C
    return 6 * n + 12.0 * L * q * T


def base_overrides(ctx, name):
    b = BENCH[name]
    o = []
    if name in SYNTHETIC:
        o += ["--vars.data_dir", str(DATA / SYNTHETIC[name][0])]
    elif name == "shakespeare":
        o += ["--vars.data_dir", str(SHAKESPEARE)]
    if ctx.smoke:
        o += ["--compute_config.device", "cpu"] + b["smoke"]
    if ctx.a.precision:
        o += ["--precision", ctx.a.precision]
    return o


def steps_of(ctx, name):
    b = BENCH[name]
    return b["smoke_steps"] if ctx.smoke else (b["steps"], b["log_every"], b["drop"])


def read_metrics(path, drop, upto=None):
    """Steps kept (after `drop`, up to `upto`: later ones were profiled), their mean
    and median ms/step, the other fields."""
    recs = [json.loads(l) for l in pathlib.Path(path).read_text().splitlines() if l.strip()]
    if upto is not None:
        recs = [r for r in recs if r.get("step", 0) <= upto]
    train = [r for r in recs if "ms_per_step" in r]
    vals = [r for r in recs if "val_loss" in r]
    kept, prev = [], 0
    for r in train:
        n = r["step"] - prev
        prev = r["step"]
        if r["step"] - n >= drop:
            kept.append((n, r))
    out = {"records": len(train), "val_losses": [(r["step"], r["val_loss"]) for r in vals]}
    if train:
        out["loss_first"], out["loss_last"] = train[0].get("loss"), train[-1].get("loss")
        out["peak_mem_mb"] = max(r.get("peak_mem_mb", 0) for r in train)
        for k in sorted({k for r in train for k in r if k.startswith("peak_") and k != "peak_mem_mb"}):
            out[k] = max(r.get(k, 0) for r in train)
    if kept:
        steps = sum(n for n, _ in kept)
        out["steps_timed"] = steps
        out["ms_per_step"] = sum(n * r["ms_per_step"] for n, r in kept) / steps
        out["ms_per_step_median"] = statistics.median(r["ms_per_step"] for _, r in kept)
        mfus = [r["mfu"] for _, r in kept if "mfu" in r]
        if mfus:
            out["mfu_reported"] = statistics.mean(mfus)
        # Step-time split (data wait, forward, backward, optimizer, communication), if logged.
        split = sorted({k for _, r in kept for k in r if k.endswith("_ms") and isinstance(r[k], (int, float))})
        if split:
            out["split_ms"] = {k: statistics.mean(r[k] for _, r in kept if k in r) for k in split}
    return out


def run_nnstrain(ctx, name, tag, config, overrides, drop, timeout, env=None, upto=None):
    """One nnstrain training run: its metrics after `drop` steps, up to `upto` (or error / oom)."""
    d = ctx.out / name
    d.mkdir(exist_ok=True)
    run_dir = ROOT / "runs" / "battery" / name / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    # Eager unless the row asks for graphs: cuda_graphs defaults to auto, and the
    # eager rows are the baseline the graph rows are read against.
    graphs = [] if "--compute_config.cuda_graphs" in map(str, overrides) else ["--compute_config.cuda_graphs", "false"]
    cmd = [ctx.a.nnstrain, "--config", CONFIGS / config, "--run_dir", run_dir, *overrides, *graphs]
    t0 = time.time()
    rc, text = run_cmd(cmd, d / f"nnstrain_{tag}.log", timeout, env=env)
    wall = time.time() - t0
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        shutil.copy(metrics, d / f"metrics_{tag}.jsonl")
    res = {"rc": rc, "wall_s": wall, "overrides": list(map(str, overrides))}
    if rc != 0:
        res["oom"] = is_oom(rc, text)
        res["error"] = error_of(rc, text)
    if metrics.exists():
        res.update(read_metrics(metrics, drop, upto))
    return res


def run_plan(ctx, name, overrides, saved_as="plan.json", folder=None):
    """`nnstrain plan --json` for the same overrides: estimate and recompute."""
    cfg = CONFIGS / BENCH[name]["config"]
    # Run-only keys the plan command takes as config overrides too; the run dir does not matter.
    cmd = [ctx.a.nnstrain, "plan", "--config", cfg, "--json", "--runtime-ngpus", "1",
           "--device", plan_device_name(ctx.results["env"]), *overrides]
    try:
        p = subprocess.run(list(map(str, cmd)), cwd=ROOT, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"nnstrain plan: {e}"}
    d = ctx.out / (folder or name)
    d.mkdir(exist_ok=True)
    (d / saved_as).write_text(p.stdout or p.stderr)
    if p.returncode != 0:
        return {"error": p.stderr.strip()[-400:]}
    plan = json.loads(p.stdout)["plan"]
    est = plan.get("estimate", {})
    return {"device": plan.get("device"), "estimate_total_mb": est.get("total_bytes", 0) / 2**20,
            "estimate": {k: v for k, v in est.items()}, "recompute_layers": sum(plan.get("recompute", [])),
            "tp": plan.get("tp"), "zero": plan.get("zero"), "step_s_estimate": est.get("step_s")}


# ---------------------------------------------------------------- the PyTorch reference

def run_reference(ctx, name, mode, cfg, batch, cap, timing=None, folder=None, extra=()):
    """reference.py on the shapes of nnstrain's resolved config; halves the batch on OOM.
    timing: (steps, log_every, drop) instead of the benchmark's; folder: where the
    logs go (default: the benchmark's); extra: more reference.py arguments."""
    steps, log_every, drop = timing or steps_of(ctx, name)
    m, tr, o = cfg["model"]["args"], cfg["dataset"]["train_args"], cfg["optimizer"]["args"]
    s = cfg["lr_scheduler"]["args"]
    args = ["--mode", mode, "--device", ctx.device, "--data", tr["path"], "--dtype", tr["dtype"],
            "--seq-len", tr["seq_len"], "--warmup", drop, "--steps", steps - drop, "--log-every", log_every,
            "--lr", o["lr"], "--min-lr", s["min_lr"], "--warmup-iters", s["warmup_steps"],
            "--lr-decay-iters", s["decay_steps"] or cfg["max_train_steps"], "--beta1", o["betas"][0],
            "--beta2", o["betas"][1], "--eps", o["eps"], "--weight-decay", o["weight_decay"],
            "--clip", cfg["optimizer"]["clip_gnorm"], "--seed", cfg["seed"]]
    if cfg["precision"] == "bf16-mixed":
        args.append("--bf16")
    if cfg["model"]["type"] == "gpt":
        args += ["--model", "gpt", "--vocab-size", m["vocab_size"], "--n-layer", m["n_layer"], "--n-head",
                 m["n_head"], "--n-embd", m["n_embd"], "--dropout", m["dropout"]]
        if m["bias"]:
            args.append("--bias")
    else:
        args += ["--model", "llama", "--vocab-size", m["vocab_size"], "--n-layer", m["num_hidden_layers"],
                 "--n-head", m["num_attention_heads"], "--n-kv-head", m["num_key_value_heads"],
                 "--head-dim", m.get("head_dim") or 0, "--n-embd", m["hidden_size"],
                 "--ffn", m["intermediate_size"], "--rope-theta", m["rope_theta"], "--norm-eps",
                 m["rms_norm_eps"]]
        if m["tie_word_embeddings"]:
            args.append("--tie")
    tries = []
    while batch >= 1:
        log(f"{name}: PyTorch {mode}, batch {batch}")
        rc, text = run_cmd([ctx.a.python, HERE / "reference.py", *args, *extra, "--batch", batch],
                           ctx.out / (folder or name) / f"pytorch_{mode}_b{batch}.log", ctx.left(cap))
        res = last_json_line(text) or {}
        if rc == 0 and "ms_per_step" in res:
            res["tries"] = tries
            return res
        oom = res.get("oom") or is_oom(rc, text)
        tries.append({"batch": batch, "rc": rc, "oom": bool(oom)})
        if not oom:
            return {"error": error_of(rc, text), "rc": rc, "tries": tries}
        batch //= 2
    return {"error": "out of memory at every batch", "tries": tries}


# ---------------------------------------------------------------- benchmarks

def ensure_synthetic(ctx, name):
    folder, dtype, n_ids = SYNTHETIC[name]
    if ctx.smoke:
        n_ids = BENCH[name]["smoke_vocab"]
    path = DATA / folder / "train.bin"
    n_tokens = 200_000 if ctx.smoke else 16 * 2**20
    if path.exists() and path.stat().st_size == n_tokens * (2 if dtype == "uint16" else 4):
        return path
    import numpy as np
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(1234).integers(0, n_ids, n_tokens, dtype=np.dtype(dtype))
    ids.tofile(path)
    log(f"wrote {path} ({n_tokens} {dtype} tokens from [0, {n_ids}))")
    return path


def spec_peak_tflops(env):
    """The device's dense bf16 peak from its datasheet (H100/H200 SXM 989, H100 PCIe 756,
    A100 312), the second MFU denominator issue 37 (b) asks for; None elsewhere (CPU)."""
    name = env.get("device", "")
    if "H100" in name and "PCIe" in name:
        return 756.0
    if "H100" in name or "H200" in name:
        return 989.0
    if "A100" in name:
        return 312.0
    return None


def add_mfu(ctx, res, fpt, rate_tflops):
    """MFU = FLOPs/token x tokens/s / rate, against the matmul rate measured in this call
    (mfu) and against the datasheet peak (mfu_spec)."""
    if not (res.get("ms_per_step") and res.get("tokens_per_s")):
        return
    if rate_tflops:
        res["mfu"] = fpt * res["tokens_per_s"] / (rate_tflops * 1e12)
    spec = spec_peak_tflops(ctx.results["env"])
    if spec:
        res["mfu_spec"] = fpt * res["tokens_per_s"] / (spec * 1e12)


class KernelTables:
    """kernel_table.py's tables for a folder's traces: each trace summarized as it
    comes (into its run's results: kernel ms/step, attention, the top kernels),
    compressed, and the folder's kernels.md / kernels.json rewritten, so a phase
    cut short keeps what it profiled."""

    def __init__(self, ctx, folder, title):
        sys.path.insert(0, str(HERE))
        import kernel_table
        self.kt, self.ctx, self.title = kernel_table, ctx, title
        self.dir = ctx.out / folder
        self.dir.mkdir(exist_ok=True)
        self.summaries = {}

    def add(self, label, trace, steps, res):
        if trace is not None and pathlib.Path(trace).exists():
            try:
                sm = self.kt.summarize(trace, steps)
                self.summaries[label] = sm
                res.update(kernel_ms_per_step=sm["ms_per_step"], attention=sm["attention"],
                           attention_kernels=sm["attention_kernels"], top=sm["top"], trace_source=sm["source"])
            except (OSError, ValueError, KeyError) as e:
                res["kernels_error"] = f"trace {trace}: {e!r}"
            subprocess.run(["gzip", "-f", str(trace)], check=False)  # kept, compressed (Perfetto opens .gz)
        elif "error" not in res:
            res["kernels_error"] = res.get("profile_error") or "no trace written"
        (self.dir / "kernels.md").write_text(self.kt.markdown(self.summaries, self.title))
        (self.dir / "kernels.json").write_text(json.dumps(self.summaries, indent=2) + "\n")
        self.ctx.save()


def bench_timed(ctx, name):
    """nnstrain (batch probed where the benchmark lists candidates), then eager and compile."""
    b = BENCH[name]
    if name in SYNTHETIC:
        ensure_synthetic(ctx, name)
    elif not (SHAKESPEARE / "train.bin").exists():
        ctx.results["benchmarks"][name] = {"error": "data/shakespeare_char/train.bin missing: run "
                                           "`build/nnstrain prepare shakespeare_char` here and carry data/shakespeare_char"}
        ctx.save()
        return
    rate = ensure_matmul(ctx).get("tflops_median")
    steps, log_every, drop = steps_of(ctx, name)
    base = base_overrides(ctx, name)
    # Issue 37 (b)'s kernel tables: `kernels` more steps after the timed ones, profiled (nnstrain's
    # profile: window, torch.profiler in reference.py) and left out of the timings.
    prof = b.get("kernels", 0)
    tables = KernelTables(ctx, name, f"Kernel profile of the {name} benchmark: nnstrain, PyTorch eager, "
                          f"torch.compile ({prof} steps after the timed ones, same batch)") if prof else None
    timing = ["--max_train_steps", str(steps + prof), "--log_progress_every_n_train_steps", str(log_every),
              "--val_every_n_train_steps", "0"]
    batches = b.get("smoke_batches") if ctx.smoke else b["batches"]
    entry = ctx.results["benchmarks"].setdefault(name, {})
    entry.update(config=f"bench/gpu/configs/{b['config']}", steps=steps, log_every=log_every,
                 steps_dropped=drop)

    # nnstrain: the first candidate (largest first) that runs without running out of memory.
    probes, nn = [], None
    trace_dir = lambda mb: ctx.out / name / f"trace_nnstrain_b{mb}"
    # A candidate the planner already puts over the device's memory is not started (its
    # estimates run below the allocator's peak, never above: such a run would only OOM,
    # after the model's start-up, at device time's cost).
    device_mb = 1024 * ctx.results["env"].get("device_memory_gb", 0)
    for i, mb in enumerate(batches or [None]):
        over = base + timing + (["--micro_batch_size", str(mb)] if mb else [])
        if mb and device_mb and i + 1 < len(batches):
            est = run_plan(ctx, name, over, saved_as=f"plan_b{mb}.json").get("estimate_total_mb")
            if est and est > device_mb:
                probes.append({"micro_batch": mb, "rc": None, "oom": False,
                               "skipped": f"plan estimate {est:.0f} MiB > device {device_mb:.0f} MiB"})
                log(f"{name}: micro-batch {mb} skipped, planner estimate {est:.0f} MiB > {device_mb:.0f} MiB")
                continue
        profile = ["--profile.steps", f"[{steps + 1},{steps + prof}]", "--profile.dir", str(trace_dir(mb))]
        log(f"{name}: nnstrain" + (f", micro-batch {mb}" if mb else ""))
        res = run_nnstrain(ctx, name, f"b{mb}" if mb else "timing", b["config"], over + (profile if prof else []),
                           drop, ctx.left(b["cap_nnstrain"]), upto=steps)
        probes.append({"micro_batch": mb, "rc": res["rc"], "oom": res.get("oom", False)})
        if res["rc"] == 0 or not res.get("oom"):
            nn = res
            break
    entry["probes"] = probes
    if nn is None:
        entry["nnstrain"] = {"error": "out of memory at every micro-batch candidate"}
        ctx.save()
        return
    cfg = resolved_config(ctx, CONFIGS / b["config"], over)
    fpt = flops_per_token(cfg)
    tokens_step = cfg["micro_batch_size"] * cfg["dataset"]["train_args"]["seq_len"]
    if "ms_per_step" in nn:
        nn["tokens_per_s"] = tokens_step / nn["ms_per_step"] * 1000.0
    add_mfu(ctx, nn, fpt, rate)
    entry.update(micro_batch=cfg["micro_batch_size"], seq_len=cfg["dataset"]["train_args"]["seq_len"],
                 precision=cfg["precision"], flops_per_token=fpt, tokens_per_step=tokens_step,
                 matmul_tflops=rate, nnstrain=nn)
    if tables:
        tables.add(f"{name}/nnstrain", trace_dir(mb) / "trace_rank0.json", prof, nn)
    entry["plan"] = run_plan(ctx, name, over)
    meas = nn.get("peak_mem_mb")
    if meas and entry["plan"].get("estimate_total_mb"):
        entry["plan"]["measured_peak_mb"] = meas
        entry["plan"]["error"] = entry["plan"]["estimate_total_mb"] / meas - 1.0
    ctx.save()

    # The same run with the whole step captured in a CUDA graph (compute_config.cuda_graphs;
    # one GPU only, so not in the CPU smoke test). Capture needs memory beside the
    # step's own: on OOM it steps down the remaining micro-batch candidates.
    # (A run that failed only in its profiled steps after the timed ones still timed them.)
    if not ctx.smoke and (nn.get("rc") == 0 or nn.get("steps_timed")) and b.get("graphs", True):
        rest = batches[batches.index(cfg["micro_batch_size"]):] if batches else [None]
        for mb in rest:
            g_over = [x for x in over]
            if mb:
                g_over[g_over.index("--micro_batch_size") + 1] = str(mb)
            log(f"{name}: nnstrain with cuda_graphs" + (f", micro-batch {mb}" if mb else ""))
            g = run_nnstrain(ctx, name, f"graphs_b{mb}" if mb else "graphs", b["config"],
                             g_over + ["--compute_config.cuda_graphs", "true"], drop, ctx.left(b["cap_nnstrain"]),
                             upto=steps)
            g["batch"] = mb or cfg["micro_batch_size"]
            if "ms_per_step" in g:
                g["tokens_per_s"] = g["batch"] * entry["seq_len"] / g["ms_per_step"] * 1000.0
            add_mfu(ctx, g, fpt, rate)
            entry["nnstrain_graphs"] = g
            ctx.save()
            if g["rc"] == 0 or not g.get("oom"):
                break

    # The PyTorch loops on the same shapes, data and batch. Compile starts at the
    # batch eager fitted: an OOM found only after compiling costs a minute.
    batch = cfg["micro_batch_size"]
    for mode in ("eager", "compile"):
        if ctx.a.skip_compile and mode == "compile":
            continue
        path = ctx.out / name / f"trace_{mode}.json"
        extra = ["--profile", path, "--profile-steps", prof] if prof else []
        ref = run_reference(ctx, name, mode, cfg, batch, b[f"cap_{mode}"], extra=extra)
        batch = ref.get("batch", batch)
        if tables:
            tables.add(f"{name}/{mode}", path if "profile_trace" in ref else None, prof, ref)
        add_mfu(ctx, ref, fpt, rate)
        entry[f"pytorch_{mode}"] = ref
        for who, n in (("", nn), ("graphs_", entry.get("nnstrain_graphs", {}))):
            if n.get("tokens_per_s") and ref.get("tokens_per_s"):
                entry[f"{who}ratio_vs_{mode}"] = n["tokens_per_s"] / ref["tokens_per_s"]
        ctx.save()


def bench_full(ctx):
    """shakespeare_char as written: 5000 steps, evaluation every 250 steps."""
    name = "shakespeare_full"
    if not (SHAKESPEARE / "train.bin").exists():
        ctx.results["benchmarks"][name] = {"error": f"{SHAKESPEARE}/train.bin missing"}
        ctx.save()
        return
    over = base_overrides(ctx, "shakespeare")
    if ctx.smoke:
        over += ["--max_train_steps", "40", "--val_every_n_train_steps", "20", "--max_val_steps", "4",
                 "--lr_scheduler.args.decay_steps", "40", "--lr_scheduler.args.warmup_steps", "5"]
    (ctx.out / name).mkdir(exist_ok=True)
    log("shakespeare_full: nnstrain, the whole run")
    res = run_nnstrain(ctx, name, "full", BENCH["shakespeare"]["config"], over, 0, ctx.left(600))
    vals = res.get("val_losses", [])
    if vals:
        best = min(vals, key=lambda sv: sv[1])
        res["best_val_loss"], res["best_val_step"] = best[1], best[0]
        res["final_val_loss"] = vals[-1][1]
    ctx.results["benchmarks"][name] = {"config": "bench/gpu/configs/shakespeare_char.yaml", "nnstrain": res,
                                       "goal": "best val loss <= 1.48; nanoGPT: 1.4697 in ~3 min on an A100"}
    ctx.save()


# ---------------------------------------------------------------- summary

def bench_zero(ctx):
    """ZeRO stages 0-3 at one rank (NCCL on one-rank groups for stages 2 and 3):
    GPT-2 124M, the same seed and data: losses against stage 0 (correctness of
    ZeRO-3's gather/free/reduce on CUDA streams), allocator peak and the
    planner's estimate for each stage, ms/step."""
    name = "gpt2"
    ensure_synthetic(ctx, name)
    steps, micro = (6, 4) if ctx.smoke else (30, 16)
    out = ctx.results["benchmarks"].setdefault("zero", {"micro_batch_size": micro, "steps": steps, "runs": {}})
    base = base_overrides(ctx, name) + ["--micro_batch_size", micro, "--max_train_steps", steps,
                                        "--log_progress_every_n_train_steps", 1]
    losses = {}
    # Stages 2 and 3 again with gradient accumulation 4 (same micro-batch): their
    # peak must stay within 5% of accumulation 1's. Temporaries a collective's work
    # object kept alive past the step's use of them (the timeout monitor once held
    # every NCCL work until it saw it complete) would pile up over micro-steps.
    # (TORCH_NCCL_AVOID_RECORD_STREAMS=1 rows are gone: it is this LibTorch's default.)
    variants = [(s, f"stage{s}", 1) for s in (0, 1, 2, 3)] + [(s, f"stage{s}_acc4", 4) for s in (2, 3)]
    for stage, tag, accum in variants:
        o = base + ["--compute_config.use_zero", stage, "--grad_accumulation_steps", accum,
                    "--global_batch_size", micro * accum]
        res = run_nnstrain(ctx, "zero", tag, BENCH[name]["config"], o, drop=5, timeout=ctx.left(150))
        metrics = ctx.out / "zero" / f"metrics_{tag}.jsonl"
        if metrics.exists() and accum == 1:
            recs = [json.loads(l) for l in metrics.read_text().splitlines() if '"loss"' in l]
            losses[stage] = {r["step"]: r["loss"] for r in recs}
        plan = run_plan(ctx, name, o, f"plan_{tag}.json", "zero")
        res["plan"] = plan
        measured = res.get("peak_tensor_mb") or res.get("peak_mem_mb")  # what the estimate predicts
        if measured and plan.get("estimate_total_mb"):
            res["estimate_error"] = plan["estimate_total_mb"] / measured - 1
        if stage in losses and 0 in losses:
            common = sorted(set(losses[stage]) & set(losses[0]))
            res["max_rel_loss_diff_vs_stage0"] = max(
                (abs(losses[stage][s] - losses[0][s]) / abs(losses[0][s]) for s in common), default=None)
        out["runs"][tag] = res
        ctx.save()
        log(f"zero {tag}: rc {res['rc']}, {res.get('ms_per_step', 0):.1f} ms/step, peak "
            f"{res.get('peak_mem_mb', 0):.0f} MiB (step {res.get('peak_tensor_mb', 0):.0f}), estimate {plan.get('estimate_total_mb', 0):.0f} MiB, "
            f"vs stage 0 {res.get('max_rel_loss_diff_vs_stage0')}")


def bench_muon(ctx):
    """Muon + AdamW against AdamW alone, the optimizer step (issue 41): GPT-2 124M on one GPU in the
    config's bf16-mixed (fp32 masters; Newton-Schulz in bf16, `ns_dtype: auto`), micro-batch 8 x 1024,
    eager (Muon refuses `cuda_graphs: true`; AdamW runs eager too), no clipping, so `time_optimizer_ms`
    (CUDA events around the optimizer part) is the step alone: its median over the steps after the
    first `drop`, ms/step beside it. Baseline in the same phase: torch.optim.Muon (bf16 Newton-Schulz)
    + AdamW(fused) and AdamW(fused) alone on the same shapes (bench/optimizer_step_reference.py)."""
    name = "gpt2"
    ensure_synthetic(ctx, name)
    steps, drop, micro = (6, 2, 4) if ctx.smoke else (12, 4, 8)
    seq = 64 if ctx.smoke else 1024  # the smoke shapes' block (BENCH["gpt2"]["smoke"]), else the config's
    out = ctx.results["benchmarks"].setdefault("muon", {"micro_batch_size": micro, "seq_len": seq, "steps": steps,
                                                        "steps_dropped": drop, "runs": {}})
    base = base_overrides(ctx, name) + ["--micro_batch_size", micro, "--max_train_steps", steps,
                                        "--log_progress_every_n_train_steps", 1, "--optimizer.clip_gnorm", 0]
    muon = ["--optimizer.type", "muon", "--optimizer.args", "{lr: 0.02}", "--optimizer.adamw_args",
            "{lr: 6.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1, impl: fused}"]
    for tag, extra in (("adamw", []), ("muon", muon)):
        res = run_nnstrain(ctx, "muon", tag, BENCH[name]["config"], base + extra, drop=drop, timeout=ctx.left(60))
        metrics = ctx.out / "muon" / f"metrics_{tag}.jsonl"
        if metrics.exists():
            recs = [json.loads(l) for l in metrics.read_text().splitlines() if '"loss"' in l]
            opt = [r["time_optimizer_ms"] for r in recs if r["step"] > drop and "time_optimizer_ms" in r]
            if opt:
                res["optimizer_ms_median"], res["optimizer_ms_min"] = statistics.median(opt), min(opt)
                res["optimizer_ms_steps"] = opt
        active = ROOT / "runs" / "battery" / "muon" / tag / "active" / "rank0.json"
        if active.exists():  # what ran, as the run recorded it (Muon: "muon (bf16 ...)" and a momentum_buffer)
            res["active_optimizer"] = json.loads(active.read_text()).get("optimizer")
        out["runs"][tag] = res
        ctx.save()
        log(f"muon {tag}: rc {res['rc']}, optimizer {fmt(res.get('optimizer_ms_median'), '.2f')} ms, "
            f"{fmt(res.get('ms_per_step'), '.1f')} ms/step")
    a, m = out["runs"]["adamw"], out["runs"]["muon"]
    if a.get("optimizer_ms_median") and m.get("optimizer_ms_median"):
        out["muon_vs_adamw"] = m["optimizer_ms_median"] / a["optimizer_ms_median"]
    shape = (["--n-layer", 2, "--n-embd", 32, "--vocab-size", 512] if ctx.smoke else
             ["--n-layer", 12, "--n-embd", 768, "--vocab-size", 50304]) + ["--seq", seq]
    log("muon: PyTorch reference (torch.optim.Muon, AdamW fused)")
    rc, text = run_cmd([ctx.a.python, ROOT / "bench" / "optimizer_step_reference.py", "--device", ctx.device,
                        "--steps", steps - drop, "--warmup", drop, "--lr", 0.02, *shape],
                       ctx.out / "muon" / "pytorch.log", ctx.left(60))
    lines = [json.loads(l) for l in text.splitlines() if l.startswith("{") and l.rstrip().endswith("}")]
    for r in lines:
        out["runs"][f"pytorch_{r['case']}"] = {"optimizer_ms_median": statistics.median(r["ms"]),
                                               "optimizer_ms_min": min(r["ms"]), "optimizer_ms_steps": r["ms"],
                                               "torch": r["torch"]}
    if rc != 0 or not lines:
        out["runs"]["pytorch"] = {"rc": rc, "error": error_of(rc, text)}
    ctx.save()


def bench_moe(ctx):
    """Mixture-of-Experts (issue 38): the Qwen3-MoE of configs/qwen3_moe_gpu.yaml on one GPU, bf16-mixed,
    its experts' GEMMs grouped (what `auto` picks on this device: at::_grouped_mm on sm90+ in bf16, else a
    padded bmm) against the per-expert loop (NNSTRAIN_KERNELS=composite): tokens/s, ms/step and MFU counting
    active parameters (the model's flops_per_token: attention, router, k experts, shared experts), the kernel
    each run recorded (run_dir/active: first_step.grouped_gemm) and the losses of the two (equal to rounding)."""
    name = "gpt2"  # the synthetic tokens it reads
    ensure_synthetic(ctx, name)
    steps, drop, micro = (6, 2, 2) if ctx.smoke else (20, 8, 8)
    smoke = (["--compute_config.device", "cpu", "--model.args.hidden_size", 64, "--model.args.num_hidden_layers", 2,
              "--model.args.num_attention_heads", 4, "--model.args.num_key_value_heads", 2,
              "--model.args.head_dim", 16, "--model.args.num_experts", 8, "--model.args.num_experts_per_tok", 2,
              "--model.args.moe_intermediate_size", 32, "--model.args.intermediate_size", 128,
              "--model.args.vocab_size", 512, "--vars.seq_len", 64] if ctx.smoke else [])
    over = ["--vars.data_dir", str(DATA / SYNTHETIC[name][0]), *smoke, "--micro_batch_size", micro,
            "--max_train_steps", steps, "--log_progress_every_n_train_steps", 1]
    if ctx.a.precision:
        over += ["--precision", ctx.a.precision]
    out = ctx.results["benchmarks"].setdefault("moe", {"config": "bench/gpu/configs/qwen3_moe_gpu.yaml",
                                                       "micro_batch_size": micro, "steps": steps,
                                                       "steps_dropped": drop, "runs": {}})
    losses = {}
    for tag, env in (("grouped", None), ("loop", {**os.environ, "NNSTRAIN_KERNELS": "composite"})):
        res = run_nnstrain(ctx, "moe", tag, "qwen3_moe_gpu.yaml", over, drop=drop, timeout=ctx.left(120), env=env)
        active = ROOT / "runs" / "battery" / "moe" / tag / "active" / "rank0.json"
        if active.exists():
            res["grouped_gemm"] = json.loads(active.read_text()).get("first_step", {}).get("grouped_gemm")
        metrics = ctx.out / "moe" / f"metrics_{tag}.jsonl"
        if metrics.exists():
            recs = [json.loads(l) for l in metrics.read_text().splitlines() if '"loss"' in l]
            losses[tag] = {r["step"]: r["loss"] for r in recs}
            kept = [r for r in recs if r["step"] > drop]
            for key, field in (("tokens_per_s", "tokens_per_s"), ("mfu_active_median", "mfu")):
                vals = [r[field] for r in kept if field in r]
                if vals:
                    res[key] = statistics.median(vals)
        out["runs"][tag] = res
        ctx.save()
        log(f"moe {tag}: rc {res['rc']}, kernel {res.get('grouped_gemm')}, {fmt(res.get('tokens_per_s'), '.0f')} tok/s, "
            f"{fmt(res.get('ms_per_step'), '.1f')} ms/step, mfu {fmt(res.get('mfu_active_median'), '.3f')}")
    g, l = out["runs"].get("grouped", {}), out["runs"].get("loop", {})
    if g.get("tokens_per_s") and l.get("tokens_per_s"):
        out["grouped_vs_loop"] = g["tokens_per_s"] / l["tokens_per_s"]
    common = sorted(set(losses.get("grouped", {})) & set(losses.get("loop", {})))
    if common:
        out["max_rel_loss_diff"] = max(abs(losses["grouped"][s] - losses["loop"][s]) / abs(losses["loop"][s])
                                       for s in common)
    ctx.save()


def held_from_log(path):
    """(device bytes, host bytes) rank 0 held between steps, from its log (offload prints the host's)."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError:
        return None, None
    m = re.search(r"held between steps: parameters (\d+), gradients (\d+), masters (\d+), optimizer moments (\d+)", text)
    h = re.search(r"held on the host between steps \(offload\): weights (\d+), gradients (\d+), optimizer moments "
                  r"(\d+), parameters and staging (\d+)", text)
    return (sum(map(int, m.groups())) if m else None), (sum(map(int, h.groups())) if h else 0)


def bench_offload(ctx):
    """Optimizer and parameter offload on one GPU (issue 23): GPT-2 124M in the
    config's precision at a batch whose step takes about a second or more
    (gradient accumulation 8), with and without offload: ms/step and tokens/s
    (goal: optimizer offload keeps >= 80% of the tokens/s), the step-time split
    (the host wait and CPU step fall in the optimizer part), the bytes held on
    the device between steps against the planner's estimate (goal: the fall
    equals the offloaded share within 5%), host bytes, losses against the run
    without offload. Not here: the largest model that fits (a sweep of
    Llama shapes, each a run near the memory limit)."""
    name = "gpt2"
    ensure_synthetic(ctx, name)
    steps, micro, accum = (6, 4, 2) if ctx.smoke else (12, 16, 8)
    out = ctx.results["benchmarks"].setdefault("offload", {"micro_batch_size": micro, "accumulation": accum,
                                                           "steps": steps, "runs": {}})
    base = base_overrides(ctx, name) + ["--micro_batch_size", micro, "--grad_accumulation_steps", accum,
                                        "--max_train_steps", steps, "--log_progress_every_n_train_steps", 1]
    off = ["--compute_config.offload.optimizer", "true"]
    variants = [("plain", []), ("optimizer", off), ("optimizer_ratio_0.5", off + ["--compute_config.offload.ratio", 0.5]),
                ("zero2", ["--compute_config.use_zero", 2]), ("zero2_optimizer", ["--compute_config.use_zero", 2] + off),
                ("zero3", ["--compute_config.use_zero", 3]),
                ("zero3_optimizer_params", ["--compute_config.use_zero", 3] + off + ["--compute_config.offload.params", "true"])]
    losses = {}
    for tag, extra in variants:
        o = base + extra
        res = run_nnstrain(ctx, "offload", tag, BENCH[name]["config"], o, drop=2, timeout=ctx.left(150))
        run_dir = ROOT / "runs" / "battery" / "offload" / tag
        res["held_device_bytes"], res["held_host_bytes"] = held_from_log(run_dir / "logs" / "rank0.log")
        metrics = ctx.out / "offload" / f"metrics_{tag}.jsonl"
        if metrics.exists():
            recs = [json.loads(l) for l in metrics.read_text().splitlines() if '"loss"' in l]
            losses[tag] = {r["step"]: r["loss"] for r in recs}
            res["split_ms"] = {k: statistics.median(r.get(k, 0) for r in recs[2:] or recs)
                               for k in ("time_forward_ms", "time_backward_ms", "time_comm_ms", "time_optimizer_ms")}
        plan = run_plan(ctx, name, o, f"plan_{tag}.json", "offload")
        res["plan"] = plan
        ref = {"optimizer": "plain", "optimizer_ratio_0.5": "plain", "zero2_optimizer": "zero2",
               "zero3_optimizer_params": "zero3"}.get(tag)
        if ref in out["runs"] and ref in losses and tag in losses:
            r0 = out["runs"][ref]
            common = sorted(set(losses[tag]) & set(losses[ref]))
            res["max_rel_loss_diff"] = max((abs(losses[tag][s] - losses[ref][s]) / abs(losses[ref][s]) for s in common),
                                           default=None)
            if r0.get("tokens_per_s") and res.get("tokens_per_s"):
                res["tokens_per_s_vs_no_offload"] = res["tokens_per_s"] / r0["tokens_per_s"]
            if r0.get("held_device_bytes") and res.get("held_device_bytes") is not None:
                measured = r0["held_device_bytes"] - res["held_device_bytes"]
                est = (r0["plan"].get("estimate", {}).get("optim_bytes", 0) + r0["plan"].get("estimate", {}).get("param_bytes", 0)
                       - plan.get("estimate", {}).get("optim_bytes", 0) - plan.get("estimate", {}).get("param_bytes", 0))
                res["device_fall_bytes"], res["device_fall_estimate_bytes"] = measured, est
                res["device_fall_error"] = measured / est - 1 if est else None
        out["runs"][tag] = res
        ctx.save()
        log(f"offload {tag}: rc {res['rc']}, {res.get('ms_per_step', 0):.1f} ms/step, held device "
            f"{(res.get('held_device_bytes') or 0) / 2**20:.0f} MiB host {(res.get('held_host_bytes') or 0) / 2**20:.0f} MiB, "
            f"vs no offload {res.get('tokens_per_s_vs_no_offload')}, loss diff {res.get('max_rel_loss_diff')}")


# ---------------------------------------------------------------- profile (issue 20)

# Per benchmark: the batch every column profiles at (the issue's GPT-2 batch; the
# Llama batch the references fitted on an H100), untimed steps, profiled steps,
# caps in seconds.
PROFILE = {
    "gpt2": dict(batch=64, smoke_batch=4, warm=5, steps=2, cap_nnstrain=150, cap_eager=150, cap_compile=240),
    "llama": dict(batch=3, smoke_batch=2, warm=4, steps=2, cap_nnstrain=180, cap_eager=180, cap_compile=300),
}


def bench_profile(ctx):
    """A profiler trace of GPT-2 124M and of the Llama 3.2 1B shape for nnstrain
    (its profile: window), PyTorch eager and torch.compile (torch.profiler in
    reference.py), the same batch for all three (halved on OOM, stated), then
    kernel_table.py's tables: the 15 most expensive kernels of each with their
    share, time by kind, and which attention kernel ran (KernelTables). The gpt2
    and llama phases write the same tables for their own runs; this phase
    profiles all three at one fixed batch."""
    d = ctx.out / "profile"
    out = ctx.results["benchmarks"].setdefault("profile", {"runs": {}})
    out["tables"] = "profile/kernels.md"
    tables = KernelTables(ctx, "profile", "Kernel profile: nnstrain, PyTorch eager, torch.compile "
                          "(bench/gpu battery, profile phase)")

    def tabulate(label, trace, steps, res):
        out["runs"][label] = res
        tables.add(label, trace, steps, res)

    for name in ("gpt2", "llama"):
        p, b = PROFILE[name], BENCH[name]
        ensure_synthetic(ctx, name)
        batch, total = p["smoke_batch" if ctx.smoke else "batch"], p["warm"] + p["steps"]
        while batch >= 1:
            tdir = d / f"{name}_nnstrain_b{batch}"
            over = base_overrides(ctx, name) + [
                "--micro_batch_size", str(batch), "--max_train_steps", str(total),
                "--log_progress_every_n_train_steps", str(total), "--val_every_n_train_steps", "0",
                "--profile.steps", f"[{p['warm'] + 1},{total}]", "--profile.dir", str(tdir)]
            log(f"profile {name}: nnstrain, batch {batch}")
            res = run_nnstrain(ctx, "profile", f"{name}_b{batch}", b["config"], over, 0, ctx.left(p["cap_nnstrain"]))
            if res["rc"] == 0 or not res.get("oom"):
                break
            batch //= 2
        if batch < 1:
            tabulate(f"{name}/nnstrain", None, 0, {"error": "out of memory at every batch"})
            continue
        res["batch"] = batch
        tabulate(f"{name}/nnstrain", tdir / "trace_rank0.json", p["steps"], res)
        cfg = resolved_config(ctx, CONFIGS / b["config"], over)
        for mode in ("eager", "compile"):
            if ctx.a.skip_compile and mode == "compile":
                continue
            path = d / f"{name}_{mode}_trace.json"
            ref = run_reference(ctx, name, mode, cfg, batch, p[f"cap_{mode}"], timing=(total, total, p["warm"]),
                                folder="profile", extra=["--profile", path, "--profile-steps", p["steps"]])
            batch = ref.get("batch", batch)  # compile starts at the batch eager fitted
            tabulate(f"{name}/{mode}", path if "ms_per_step" in ref else None, p["steps"], ref)


# ---------------------------------------------------------------- cp_ring (issue 22)

def bench_cp_ring(ctx):
    """One rank's share of ring attention at a 128K sequence over cp 8 (Llama 3
    8B heads: 32 / 8, dim 128, bf16, causal zigzag), forward and backward,
    against one plain SDPA call with the same unmasked FLOPs
    (bench/cp_ring.cpp; no communication: a stand-in ring). First a check at a
    small size that the stand-in computes the whole sequence's attention."""
    binary = ctx.a.cp_ring_bin
    d = ctx.out / "cp_ring"
    d.mkdir(exist_ok=True)
    out = ctx.results["benchmarks"].setdefault("cp_ring", {})
    if ctx.smoke:
        shape = ["--device", "cpu", "--dtype", "fp32", "--seq", "512", "--cp", "8", "--heads", "4", "--kv-heads", "2",
                 "--dim", "16", "--repeats", "2", "--warmup", "1"]
        check = shape + ["--check"]
    else:
        shape = ["--device", "cuda", "--dtype", "bf16", "--seq", "131072", "--cp", "8", "--heads", "32",
                 "--kv-heads", "8", "--dim", "128"]
        check = ["--device", "cuda", "--dtype", "bf16", "--seq", "8192", "--cp", "8", "--heads", "32",
                 "--kv-heads", "8", "--dim", "128", "--repeats", "1", "--warmup", "0", "--check"]
    runs = [("check", check + ["--rank", "3"])] + [(f"rank{r}", shape + ["--rank", str(r)]) for r in (0, 7)]
    for tag, args in runs:
        log(f"cp_ring {tag}")
        rc, text = run_cmd([binary, *args], d / f"{tag}.log", ctx.left(150))
        res = last_json_line(text) or {}
        res["rc"] = rc
        if rc != 0:
            res["error"] = error_of(rc, text)
        out[tag] = res
        ctx.save()
        log(f"cp_ring {tag}: rc {rc}, efficiency {res.get('efficiency')}, ring {res.get('ring_fwd_bwd_ms')} ms, "
            f"baseline {res.get('best_baseline')} {res.get('baseline_ms', {}).get(res.get('best_baseline'))} ms")


def bench_doc_attention(ctx):
    """Packed documents at cp 1 (issue 40): document_attention forward + backward by flash's varlen kernel
    (auto on CUDA), the tiles (NNSTRAIN_KERNELS=composite's form) and SDPA with the dense block-diagonal mask,
    against causal SDPA over the whole sequence (bench/doc_attention.cpp): Llama 3 8B heads (32 / 8 of 128),
    bf16, 2 x 8192 tokens of documents whose lengths vary tenfold; first a check that varlen and dense equal the
    tiles (outputs and gradients)."""
    binary = ctx.a.doc_attention_bin
    d = ctx.out / "doc_attention"
    d.mkdir(exist_ok=True)
    if ctx.smoke:
        args = ["--device", "cpu", "--dtype", "fp32", "--seq", "512", "--heads", "4", "--kv-heads", "2", "--dim", "16",
                "--repeats", "2", "--warmup", "1", "--check"]
    else:
        args = ["--device", "cuda", "--dtype", "bf16", "--seq", "8192", "--batch", "2", "--heads", "32",
                "--kv-heads", "8", "--dim", "128", "--check"]
    rc, text = run_cmd([binary, *args], d / "doc_attention.log", ctx.left(150))
    res = last_json_line(text) or {}
    res["rc"] = rc
    if rc != 0:
        res["error"] = error_of(rc, text)
    ms = res.get("fwd_bwd_ms", {})
    if ms.get("varlen") and ms.get("dense"):
        res["varlen_vs_dense"] = ms["dense"] / ms["varlen"]
    ctx.results["benchmarks"]["doc_attention"] = res
    ctx.save()
    log(f"doc_attention: rc {rc}, varlen ran {res.get('varlen_kernel_ran')}, ms {ms}")


PARALLEL_TOLERANCE = 1e-5  # the CPU parity tests' bound for the same comparisons (fp32, TF32 off)


def bench_parallel_cuda(ctx):
    """Issue 37 (e): pp 2 and cp 2 over Gloo on CUDA tensors (two ranks sharing the one GPU,
    NNSTRAIN_SHARE_DEVICES=1) and optimizer offload on CUDA, each against one process on the GPU
    (configs/parallel_small.yaml: a small Llama, fp32, TF32 off, 12 steps, the same global batch).
    Per run: the largest relative loss difference over the steps against one process, and from its
    own records what ran (every rank's pp / cp group size, the offloaded tiers, the device in its log)."""
    config = "parallel_small.yaml"
    data = SHAKESPEARE
    out = ctx.results["benchmarks"].setdefault("parallel_cuda", {"config": f"bench/gpu/configs/{config}",
                                                                 "tolerance": PARALLEL_TOLERANCE, "runs": {}})
    if not (data / "train.bin").exists():
        out["error"] = "data/shakespeare_char/train.bin missing (carry .gpu_bundle, or prepare it here)"
        ctx.save()
        return
    base = ["--vars.data_dir", data]
    if ctx.smoke:
        base += ["--compute_config.device", "cpu", "--vars.seq_len", "64", "--model.args.hidden_size", "32",
                 "--model.args.intermediate_size", "64", "--max_train_steps", "4"]
    gloo = ["--compute_config.backend", "gloo"]
    runs = [("one", 1, []),
            ("pp2", 2, gloo + ["--compute_config.pas_config.pp_size", "2"]),
            ("cp2", 2, gloo + ["--compute_config.context_parallel_size", "2"]),
            ("offload", 1, ["--compute_config.offload.optimizer", "true"])]
    losses = {}
    d = ctx.out / "parallel_cuda"
    d.mkdir(exist_ok=True)
    for tag, nproc, extra in runs:
        run_dir = ROOT / "runs" / "battery" / "parallel_cuda" / tag
        shutil.rmtree(run_dir, ignore_errors=True)
        train = ["--config", CONFIGS / config, "--run_dir", run_dir, *base, *extra]
        cmd = [ctx.a.nnstrain, *train] if nproc == 1 else [ctx.a.nnstrain, "launch", "--nproc-per-node", nproc, "--", *train]
        env = dict(os.environ, NNSTRAIN_SHARE_DEVICES="1", OMP_NUM_THREADS="2")
        rc, text = run_cmd(cmd, d / f"{tag}.log", ctx.left(90), env=env)
        res = {"rc": rc, "ranks": nproc, "overrides": list(map(str, extra))}
        if rc != 0:
            res["error"] = error_of(rc, text)
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            recs = [json.loads(l) for l in metrics.read_text().splitlines() if '"loss"' in l]
            losses[tag] = {r["step"]: r["loss"] for r in recs if "step" in r}
        # What ran, from the ranks' own records and log (not from the command line).
        ran = {}
        for rank in range(nproc):
            rec_path = run_dir / "active" / f"rank{rank}.json"
            if rec_path.exists():
                rec = json.loads(rec_path.read_text())
                ran[rank] = {"pp": rec["groups"]["pp"]["size"], "cp": rec["groups"]["cp"]["size"],
                             "offload": bool(rec.get("offload"))}
        res["ran"] = ran
        m = re.search(r"device (cuda[:0-9]*|cpu)", text)
        res["device"] = m.group(1) if m else None
        want = {"one": (1, 1, False), "pp2": (2, 1, False), "cp2": (1, 2, False), "offload": (1, 1, True)}[tag]
        res["ran_as_asked"] = len(ran) == nproc and all((r["pp"], r["cp"], r["offload"]) == want for r in ran.values()) \
            and (res["device"] or "").startswith("cpu" if ctx.smoke else "cuda")
        if tag != "one" and tag in losses and "one" in losses:
            common = sorted(set(losses[tag]) & set(losses["one"]))
            res["steps_compared"] = len(common)
            res["max_rel_loss_diff"] = max((abs(losses[tag][s] - losses["one"][s]) / abs(losses["one"][s])
                                            for s in common), default=None)
            res["pass"] = bool(rc == 0 and res["ran_as_asked"] and common and len(common) == len(losses["one"])
                               and res["max_rel_loss_diff"] <= PARALLEL_TOLERANCE)
        out["runs"][tag] = res
        ctx.save()
        log(f"parallel_cuda {tag}: rc {rc}, ran {ran}, device {res['device']}, "
            f"max rel loss diff vs one process {res.get('max_rel_loss_diff')}")


def fmt(v, spec=".1f", none="-"):
    return none if v is None else format(v, spec)


def write_summary(r, path):
    env = r.get("env", {})
    mm = r.get("matmul", {})
    L = [f"# GPU battery: nnstrain vs PyTorch eager vs torch.compile ({env.get('date', '?')})", "",
         f"- device: {env.get('device', '?')} ({env.get('device_memory_gb', '?')} GiB), driver {env.get('driver', '?')}",
         f"- LibTorch (nnstrain) {env.get('libtorch', '?')}; torch (references) {env.get('torch', '?')}, "
         f"CUDA {env.get('cuda_runtime', '?')}, cuDNN {env.get('cudnn', '?')}",
         f"- commit {env.get('commit', '?')}",
         f"- matmul rate (MFU denominator): {fmt(mm.get('tflops_median'))} TFLOP/s median "
         f"({mm.get('dtype', '?')} {mm.get('size', '?')}^3, max {fmt(mm.get('tflops_max'))})"
         + (f" ERROR {mm['error']}" if "error" in mm else "")]
    if env.get("smoke"):
        L.append("- **SMOKE TEST**: tiny shapes on the CPU; the figures mean nothing")
    for key, what in (("tests", "issue 37 (a)'s device checks"), ("tests_more", "the other device tests")):
        t = r.get(key)
        if t:
            L.append(f"- {what} (`ctest -L device`, phase {key}): {t.get('summary', '?')}"
                     + (f"; failed: {t['failed']}" if t.get("failed") else ""))
    if r.get("phases"):
        L.append("- phases (rc 124 = timed out): " + "; ".join(r["phases"]))
    L += ["", "ms/step: nnstrain = mean over the timed steps of its metrics records; PyTorch = CUDA events over "
          "the timed steps. MFU = nnstrain's FLOPs/token (the same count for every column) x tokens/s / the "
          "matmul rate measured above; in brackets the same over the datasheet's dense bf16 peak "
          f"({spec_peak_tflops(r.get('env', {})) or '-'} TFLOP/s). Ratio > 1: nnstrain "
          "faster. Memory: allocator peak (allocated) in MiB; estimate = `nnstrain plan` total.", "",
          "| benchmark | micro-batch x seq | ms/step nnstrain / eager / compile | tok/s nnstrain | "
          "MFU nnstrain / eager / compile | nnstrain vs eager / compile | peak MiB nnstrain / eager / compile | "
          "plan estimate MiB (error) |",
          "|---|---|---|---:|---|---|---|---|"]
    rows = [(name, variant) for name in ("shakespeare", "gpt2", "llama") for variant in ("", "graphs")
            if r.get("benchmarks", {}).get(name) and (not variant or "nnstrain_graphs" in r["benchmarks"][name])]
    for name, variant in rows:
        e = r["benchmarks"][name]
        n = e.get("nnstrain_graphs" if variant else "nnstrain", {})
        pe, pc = e.get("pytorch_eager", {}), e.get("pytorch_compile", {})
        pl = e.get("plan", {}) if not variant else {}
        pre = "graphs_" if variant else ""

        def ms(x):
            if "error" in x and "ms_per_step" not in x:
                return "fail"
            b = x.get("batch")
            extra = f" (b{b})" if b and b != e.get("micro_batch") else ""
            return fmt(x.get("ms_per_step"), ".2f") + extra

        def pct(x):
            got = fmt(100 * x["mfu"], ".1f") + "%" if x.get("mfu") is not None else "-"
            return got + (f" ({100 * x['mfu_spec']:.1f}%)" if x.get("mfu_spec") is not None else "")

        est = (f"{fmt(pl.get('estimate_total_mb'), '.0f')} ({fmt(100 * pl['error'], '+.1f')}%)"
               if "error" in pl and isinstance(pl.get("error"), float) else pl.get("error", "-")[:60]
               if isinstance(pl.get("error"), str) else "-")
        label = f"{name} (cuda_graphs)" if variant else name
        L.append(f"| {label} | {e.get('micro_batch', '?')} x {e.get('seq_len', '?')} | {ms(n)} / {ms(pe)} / {ms(pc)} | "
                 f"{fmt(n.get('tokens_per_s'), '.0f')} | {pct(n)} / {pct(pe)} / {pct(pc)} | "
                 f"{fmt(e.get(pre + 'ratio_vs_eager'), '.2f')} / {fmt(e.get(pre + 'ratio_vs_compile'), '.2f')} | "
                 f"{fmt(n.get('peak_mem_mb'), '.0f')} / {fmt(pe.get('peak_mem_mb'), '.0f')} / "
                 f"{fmt(pc.get('peak_mem_mb'), '.0f')} | {est} |")
    notes = []
    for name in ("shakespeare", "gpt2", "llama"):
        e = r.get("benchmarks", {}).get(name, {})
        if "error" in e:
            notes.append(f"- {name}: {e['error']}")
        for who in ("nnstrain", "nnstrain_graphs", "pytorch_eager", "pytorch_compile"):
            x = e.get(who, {})
            if "error" in x:
                notes.append(f"- {name} {who}: {x['error']}".replace("\n", " | "))
            if x.get("split_ms"):
                notes.append(f"- {name} {who} step split (ms): " +
                             ", ".join(f"{k} {v:.2f}" for k, v in x["split_ms"].items()))
            if who == "pytorch_compile" and x.get("first_step_s"):
                notes.append(f"- {name} torch.compile: first step (compilation) {x['first_step_s']:.0f} s")
        if e.get("probes") and e["probes"][0]["micro_batch"]:
            notes.append(f"- {name} micro-batch probe: " + ", ".join(
                f"{p['micro_batch']}: " + (p["skipped"] if p.get("skipped") else
                                           'OOM' if p['oom'] else ('ok' if p['rc'] == 0 else 'rc ' + str(p['rc'])))
                for p in e["probes"]))
        pl = e.get("plan", {})
        if pl.get("recompute_layers"):
            notes.append(f"- {name}: the planner chose recompute for {pl['recompute_layers']} layers")
    for name in ("gpt2", "llama"):  # issue 37 (b): the kernels of each timed run
        e = r.get("benchmarks", {}).get(name, {})
        runs = [(who, e[who]) for who in ("nnstrain", "pytorch_eager", "pytorch_compile") if e.get(who)]
        if not any("top" in x or "kernels_error" in x for _, x in runs):
            continue
        L += ["", f"## {name}: kernels after the timed steps (tables in {name}/kernels.md)", "",
              "| run | kernel ms/step | most expensive kernel (share) | attention kernel(s) |", "|---|---:|---|---|"]
        for who, x in runs:
            top = x.get("top") or [{}]
            first = (f"`{str(top[0].get('name', '-'))[:70]}` ({100 * top[0]['share']:.1f}%)"
                     if "share" in top[0] else "-")
            att = ", ".join(f"{b} {100 * v['share']:.1f}%" for b, v in x.get("attention", {}).items()) or "-"
            L.append(f"| {who} | {fmt(x.get('kernel_ms_per_step'), '.2f')} | {first} | {att}"
                     + (f" (ERROR: {x['kernels_error']})" if x.get("kernels_error") else "") + " |")
    f = r.get("benchmarks", {}).get("shakespeare_full")
    if f:
        n = f.get("nnstrain", {})
        L += ["", "## shakespeare_char, full run (5000 steps, eval every 250 x 200 batches)", "",
              f"- best val loss {fmt(n.get('best_val_loss'), '.4f')} at step {n.get('best_val_step', '-')}, "
              f"final {fmt(n.get('final_val_loss'), '.4f')} (goal <= 1.48; nanoGPT 1.4697)",
              f"- wall time {fmt(n.get('wall_s'), '.1f')} s (process start to exit, evaluation included; "
              f"nanoGPT ~3 min on an A100); mean ms/step {fmt(n.get('ms_per_step'), '.2f')} (evaluation included)",
              f"- peak memory {fmt(n.get('peak_mem_mb'), '.0f')} MiB" +
              (f"; ERROR: {n['error']}" if "error" in n else "")]
    pr = r.get("benchmarks", {}).get("profile")
    if pr:
        L += ["", "## Kernel profile (profile phase; tables in profile/kernels.md)", "",
              "| run | batch | kernel ms/step | attention kernel(s) |", "|---|---|---|---|"]
        for label, x in pr.get("runs", {}).items():
            att = ", ".join(f"{b} {100 * v['share']:.1f}%" for b, v in x.get("attention", {}).items()) or (
                "none found" if "kernel_ms_per_step" in x else "-")
            err = x.get("error") or x.get("kernels_error")
            L.append(f"| {label} | {x.get('batch', '?')} | {fmt(x.get('kernel_ms_per_step'), '.2f')} | {att}"
                     + (f" (ERROR: {err})" if err else "") + " |")
    cr = r.get("benchmarks", {}).get("cp_ring")
    if cr:
        L += ["", "## Ring attention, one rank's share (cp_ring phase; no communication)", ""]
        for tag, x in cr.items():
            if not isinstance(x, dict):
                continue
            if "error" in x:
                L.append(f"- {tag}: ERROR {x['error']}")
            elif tag == "check":
                L.append(f"- check (seq {x.get('seq')}, rank {x.get('rank')}): ring vs whole-sequence SDPA max abs "
                         f"diff {fmt(x.get('check_max_abs_diff'), '.2e')}")
            else:
                L.append(f"- {tag}: seq {x.get('seq')} cp {x.get('cp')}: ring forward + backward "
                         f"{fmt(x.get('ring_fwd_bwd_ms'), '.1f')} ms (forward {fmt(x.get('ring_fwd_ms'), '.1f')}); "
                         f"baseline {x.get('best_baseline')} "
                         f"{fmt(x.get('baseline_ms', {}).get(x.get('best_baseline')), '.1f')} ms; "
                         f"efficiency **{fmt(x.get('efficiency'), '.3f')}** (goal >= 0.85)")
    mo = r.get("benchmarks", {}).get("moe")
    if mo:
        L += ["", "## MoE: grouped expert GEMMs vs the per-expert loop (moe phase; configs/qwen3_moe_gpu.yaml)", "",
              "| run | kernel | tokens/s | ms/step | MFU (active) |", "|---|---|---:|---:|---:|"]
        for tag in ("grouped", "loop"):
            x = mo.get("runs", {}).get(tag, {})
            L.append(f"| {tag} | {x.get('grouped_gemm')} | {fmt(x.get('tokens_per_s'), '.0f')} | "
                     f"{fmt(x.get('ms_per_step'), '.1f')} | {fmt(x.get('mfu_active_median'), '.3f')} |")
        if mo.get("grouped_vs_loop"):
            L.append(f"\ngrouped / loop tokens/s: {mo['grouped_vs_loop']:.2f}x; "
                     f"max relative loss difference {fmt(mo.get('max_rel_loss_diff'), '.2e')}")
    da = r.get("benchmarks", {}).get("doc_attention")
    if da:
        ms = da.get("fwd_bwd_ms", {})
        L += ["", "## Packed documents: attention kernels (doc_attention phase; bench/doc_attention.cpp)", "",
              f"{da.get('batch')} x {da.get('seq')} tokens, {da.get('documents')} documents of {da.get('shortest')} to "
              f"{da.get('longest')}, {da.get('heads')} / {da.get('kv_heads')} heads of {da.get('dim')}, {da.get('dtype')}; "
              f"varlen kernel ran: {da.get('varlen_kernel_ran')}; check vs tiles (max abs): varlen "
              f"{fmt(da.get('check_varlen_vs_tiles_max_abs'), '.2e')}, dense {fmt(da.get('check_dense_vs_tiles_max_abs'), '.2e')}",
              "", "| kernel | forward + backward ms |", "|---|---:|"]
        for name, v in ms.items():
            L.append(f"| {name} | {fmt(v, '.2f')} |")
        if da.get("varlen_vs_dense"):
            L.append(f"\nvarlen vs dense mask: {da['varlen_vs_dense']:.2f}x faster")
    pc = r.get("benchmarks", {}).get("parallel_cuda")
    if pc:
        L += ["", f"## Pipeline, context parallelism and offload on CUDA tensors (parallel_cuda phase; "
              f"{pc.get('config')}, against one process, tolerance {pc.get('tolerance')})", "",
              "| run | ranks | rc | device | ran (pp, cp, offload per rank) | max rel loss diff | steps | pass |",
              "|---|---:|---:|---|---|---:|---:|---|"]
        for tag, x in pc.get("runs", {}).items():
            ran = "; ".join(f"{k}: {v['pp']}, {v['cp']}, {v['offload']}" for k, v in x.get("ran", {}).items())
            L.append(f"| {tag} | {x.get('ranks')} | {x.get('rc')} | {x.get('device')} | {ran} | "
                     f"{fmt(x.get('max_rel_loss_diff'), '.2e')} | {x.get('steps_compared', '-')} | {x.get('pass', '-')}"
                     + (f" ERROR: {x['error']}" if "error" in x else "") + " |")
        if pc.get("error"):
            L.append(f"\nERROR: {pc['error']}")
    mu = r.get("benchmarks", {}).get("muon")
    if mu:
        L += ["", f"## Optimizer step: Muon + AdamW vs AdamW (muon phase; GPT-2 124M, micro-batch "
              f"{mu.get('micro_batch_size')} x {mu.get('seq_len')}, median of the steps after the first {mu.get('steps_dropped')})", "",
              "| run | optimizer ms (median) | min | ms/step | what ran |", "|---|---:|---:|---:|---|"]
        for tag, x in mu.get("runs", {}).items():
            ran = (x.get("active_optimizer") or {}).get("impl", x.get("torch", ""))
            L.append(f"| {tag} | {fmt(x.get('optimizer_ms_median'), '.2f')} | {fmt(x.get('optimizer_ms_min'), '.2f')} | "
                     f"{fmt(x.get('ms_per_step'), '.1f')} | {ran}" + (f" ERROR: {x['error']}" if "error" in x else "") + " |")
        if mu.get("muon_vs_adamw"):
            L.append(f"\nnnstrain Muon / AdamW optimizer time: {mu['muon_vs_adamw']:.2f}x")
    if notes:
        L += ["", "## Notes", ""] + notes
    path.write_text("\n".join(L) + "\n")


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("phases", nargs="+",
                    choices=["matmul", "shakespeare", "shakespeare_full", "gpt2", "muon", "moe", "llama", "zero", "offload",
                             "profile", "cp_ring", "doc_attention", "parallel_cuda", "summary"])
    ap.add_argument("--results", required=True, help="results folder (added to, never emptied)")
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"))
    ap.add_argument("--python", default=sys.executable, help="Python for reference.py / matmul_probe.py")
    ap.add_argument("--precision", default="", help="override every config's precision (e.g. 32-true)")
    ap.add_argument("--time-limit", type=float, default=0, help="seconds for all phases of this call; 0 = none")
    ap.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile reference")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--cp-ring-bin", default=str(ROOT / "build" / "nnstrain_bench_cp_ring"),
                    help="the cp_ring phase's binary (bench/cp_ring.cpp)")
    ap.add_argument("--doc-attention-bin", default=str(ROOT / "build" / "nnstrain_bench_doc_attention"),
                    help="the doc_attention phase's binary (bench/doc_attention.cpp)")
    a = ap.parse_args()
    a.nnstrain = str(pathlib.Path(a.nnstrain).resolve())
    ctx = Ctx(a)
    if "env" not in ctx.results:
        ctx.results["env"] = environment(a)
        ctx.save()
    for phase in a.phases:
        log(f"phase {phase}")
        try:
            if phase == "matmul":
                ensure_matmul(ctx)
            elif phase in ("shakespeare", "gpt2", "llama"):
                bench_timed(ctx, phase)
            elif phase == "shakespeare_full":
                bench_full(ctx)
            elif phase == "zero":
                bench_zero(ctx)
            elif phase == "offload":
                bench_offload(ctx)
            elif phase == "muon":
                bench_muon(ctx)
            elif phase == "moe":
                bench_moe(ctx)
            elif phase == "profile":
                bench_profile(ctx)
            elif phase == "cp_ring":
                bench_cp_ring(ctx)
            elif phase == "doc_attention":
                bench_doc_attention(ctx)
            elif phase == "parallel_cuda":
                bench_parallel_cuda(ctx)
        except Exception as e:  # one phase's failure must not lose the others
            log(f"phase {phase} failed: {e!r}")
            ctx.results["benchmarks"].setdefault(phase, {})["error"] = f"driver: {e!r}"
        ctx.save()
    log(f"results in {ctx.out}")


if __name__ == "__main__":
    main()
