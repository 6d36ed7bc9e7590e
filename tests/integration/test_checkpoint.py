"""Checkpoints users can trust, through the nnstrain binary (tiny GPT, CPU, Gloo).

- sharded vs deduped file sizes of a dp=2 run, and deduped == merged bytes;
- same plan: 40 straight == 20 + resume + 20, bitwise, for dp=2 and ZeRO-1 dp=2
  (dp=1 is test_train_resume.py's);
- another plan: ZeRO-1 dp=2 -> dp=1 and -> dp=4, dp=4 -> ZeRO-1 dp=2, and across
  ZeRO stages: ZeRO-3 dp=4 -> dp=1 and -> ZeRO-1 dp=2, ZeRO-3 x tp=2 -> one
  process, dp=2 -> ZeRO-3 dp=4, ZeRO-2 dp=2 -> ZeRO-3 dp=2; losses after the
  resume match the uninterrupted run within 1e-5 relative (same global batch);
- atomicity: SIGKILL at 20 random moments while saving every step (asynchronous
  saves, the default, and synchronous ones); each time
  `latest` names a complete checkpoint, --resume starts there, and the chain of
  resumed runs logs exactly the uninterrupted run's losses;
- SIGTERM to one rank under the launcher: every rank saves at the next step
  boundary, exit 0, and --resume continues from that step; SIGTERM during a
  million-batch validation ends it within seconds (one process and two ranks);
- load faults (missing shard, shape, dtype, model type, corrupt safetensors ...):
  an error naming the file and the fault, exit status 1, never a crash.

Every run: OMP_NUM_THREADS=1, a metrics record every step. Losses are compared
as the JSON numbers the trainer wrote (shortest round-trip form, so equality
here is bitwise equality there).
"""
import json
import os
import pathlib
import queue
import random
import re
import shutil
import signal
import struct
import subprocess
import threading
import time

import pytest

from conftest import CONFIGS, SOURCE, Run, assert_active, device_args, nnstrain_bin_path, read_metrics, single_process_env

CONFIG = CONFIGS / "tiny_gpt.yaml"
STEPS, CUT = 40, 20

# Plans with the same global batch (8 sequences): the data stream is the same.
PLANS = {
    "dp1": (1, ["--micro_batch_size", 8]),
    "dp2": (2, []),
    "dp2_zero": (2, ["--compute_config.use_zero", "true"]),
    "dp4": (4, ["--micro_batch_size", 2]),
    "dp2_zero2": (2, ["--compute_config.use_zero", 2]),
    "dp2_zero3": (2, ["--compute_config.use_zero", 3]),
    "dp4_zero3": (4, ["--micro_batch_size", 2, "--compute_config.use_zero", 3]),
    # tp 2 x dp 2, sequence parallelism on: 2 x 4 sequences.
    "tp2_dp2_zero3": (4, ["--pas_policy", "hybrid", "--compute_config.plan_ngpus", 2, "--compute_config.use_zero", 3]),
}


def command(nproc, *overrides, run_dir, resume=None, config=CONFIG):
    args = [nnstrain_bin_path()]
    if nproc > 1:
        args += ["launch", "--nproc-per-node", str(nproc), "--"]
    args += ["--config", str(config), "--run_dir", str(run_dir), *device_args(nproc), *[str(o) for o in overrides]]
    if resume is True:
        args.append("--resume")
    elif resume is not None:
        args += ["--resume", str(resume)]
    return args


def train(nproc, *overrides, run_dir, resume=None, check=True, timeout=240):
    args = command(nproc, *overrides, run_dir=run_dir, resume=resume)
    p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True,
                       timeout=timeout)
    tr, val = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
    run = Run(args, p.returncode, p.stdout, p.stderr, tr, val)
    if check and p.returncode != 0:
        pytest.fail(f"nnstrain exited with {p.returncode}: {' '.join(args)}\n{run.output}")
    return run


def plan_run(plan, tokens, d, *more, resume=None, check=True):
    nproc, extra = PLANS[plan]
    run = train(nproc, "--vars.data", tokens, "--checkpoint.save_dir", d / "ckpt", *extra, *more,
                run_dir=d, resume=resume, check=check)
    if run.returncode == 0:
        assert_active(d, run.output, nproc, extra)  # resumes compare plans that really ran as named
    return run


def by_step(run):
    return {r["step"]: r for r in run.train}


@pytest.fixture(scope="module")
def runs(tiny_tokens, tmp_path_factory):
    """Uninterrupted 40-step runs by plan (a checkpoint every 20 steps), made once."""
    cache = {}

    def straight(plan):
        if plan not in cache:
            d = tmp_path_factory.mktemp(f"straight_{plan}")
            cache[plan] = (plan_run(plan, tiny_tokens, d, "--checkpoint.every_n_train_steps", CUT), d)
        return cache[plan]
    return straight


# ------------------------------------------------------------------ same plan


@pytest.mark.parametrize("plan,save_type", [("dp2", "deduped"), ("dp2_zero", "sharded"), ("dp2_zero3", "deduped")])
def test_resume_same_plan_is_bitwise(runs, tiny_tokens, tmp_path, plan, save_type):
    want, _ = runs(plan)
    d = tmp_path / "split"
    first = plan_run(plan, tiny_tokens, d, "--max_train_steps", CUT, "--checkpoint.save_type", save_type)
    assert sorted(first.losses()) == list(range(1, CUT + 1))
    manifest = json.loads((d / "ckpt" / "step-00000020" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["save_type"] == save_type
    second = plan_run(plan, tiny_tokens, d, "--checkpoint.save_type", save_type, resume=True)
    assert "at step 20" in second.output, second.output
    got, ref = by_step(second), by_step(want)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        for key in ("loss", "lr", "grad_norm"):
            assert got[s][key] == ref[s][key], f"{plan}: step {s} {key} {got[s][key]!r} != {ref[s][key]!r}"


# ------------------------------------------------------------------ another plan


@pytest.mark.parametrize("source,target", [("dp2_zero", "dp1"), ("dp2_zero", "dp4"), ("dp4", "dp2_zero"),
                                           ("dp4_zero3", "dp1"), ("dp4_zero3", "dp2_zero"), ("tp2_dp2_zero3", "dp1"),
                                           ("dp2", "dp4_zero3"), ("dp2_zero2", "dp2_zero3")])
def test_resume_under_another_plan(runs, tiny_tokens, tmp_path, source, target):
    want, src_dir = runs(source)
    ckpt = src_dir / "ckpt" / "step-00000020"
    assert (ckpt / "manifest.json").is_file()
    d = tmp_path / "resumed"
    got = plan_run(target, tiny_tokens, d, resume=ckpt)
    assert f"resumed from {ckpt} at step 20" in got.output, got.output
    g, w = by_step(got), by_step(want)
    assert sorted(g) == list(range(CUT + 1, STEPS + 1))
    for s in range(CUT + 1, STEPS + 1):
        assert g[s]["lr"] == w[s]["lr"]
        assert g[s]["loss"] == pytest.approx(w[s]["loss"], rel=1e-5), (
            f"{source} -> {target}: step {s} loss {g[s]['loss']!r} vs uninterrupted {w[s]['loss']!r}")


# ------------------------------------------------------------------ sizes


def safetensors_parts(path):
    """(header bytes incl. the length field, data bytes) of a safetensors file."""
    raw = pathlib.Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n, len(raw) - 8 - n


def folder_sizes(folder):
    st = [p for p in pathlib.Path(folder).iterdir() if p.suffix == ".safetensors"]
    parts = [safetensors_parts(p) for p in st]
    other = sum(p.stat().st_size for p in pathlib.Path(folder).iterdir() if p.suffix != ".safetensors")
    return {"files": len(st), "data": sum(d for _, d in parts), "headers": sum(h for h, _ in parts),
            "other": other, "total": sum(p.stat().st_size for p in pathlib.Path(folder).iterdir())}


def test_sharded_vs_deduped_sizes(runs, tiny_tokens, tmp_path):
    _, sharded_dir = runs("dp2")
    d = tmp_path / "deduped"
    plan_run("dp2", tiny_tokens, d, "--max_train_steps", CUT, "--checkpoint.save_type", "deduped")
    sharded, deduped = sharded_dir / "ckpt" / "step-00000020", d / "ckpt" / "step-00000020"
    merged = tmp_path / "merged"
    p = subprocess.run([nnstrain_bin_path(), "merge", str(deduped), "--out", str(merged)], capture_output=True,
                       text=True, env=single_process_env(1), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr

    # What one copy of everything weighs, from the manifest: model + optimizer once,
    # plus each rank's own RNG state.
    manifest = json.loads((sharded / "manifest.json").read_text())
    size = {"F32": 4, "U8": 1}
    unique, replicated = {}, 0
    for entries in manifest["files"].values():
        for e in entries:
            n = 1
            for x in e["shape"]:
                n *= x
            nbytes = n * size[e["dtype"]]
            unique[e["name"]] = nbytes
            if len(e["replica_ranks"]) > 1:
                replicated += nbytes
    one_copy = sum(unique.values())
    s, u, m = folder_sizes(sharded), folder_sizes(deduped), folder_sizes(merged)
    print(f"\ndp=2 step 20 checkpoint sizes (bytes): sharded {s}, deduped {u}, merged {m}; "
          f"one copy of every tensor {one_copy}, replicated on both ranks {replicated}")
    assert u["data"] == one_copy
    assert s["data"] == one_copy + replicated // 2  # every replicated tensor twice
    assert replicated // 2 > 0.95 * one_copy  # dp without ZeRO: nearly everything is replicated
    assert m["data"] == u["data"]
    # Totals differ only by headers, the manifest and the JSON side files.
    assert abs(m["total"] - u["total"]) <= m["headers"] + m["other"] + u["headers"] + u["other"]


# ------------------------------------------------------------------ SIGKILL while saving

# ~3.2M parameters: a checkpoint of ~38 MB, so a save takes longer than a training step.
BIG = ["--model.args.n_embd", 256, "--model.args.n_head", 4, "--model.args.n_layer", 4, "--val_every_n_train_steps", 0]
KILL_STEPS = 150
KILLS = 20


class Lines:
    """A running process's merged output, line by line, with a timeout."""

    def __init__(self, proc):
        self.proc, self.lines, self.q = proc, [], queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, pattern, timeout=120):
        """The first match of `pattern` in a new line; None if the process ended first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.q.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                return None
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{''.join(self.lines)}")

    def rest(self):
        self.proc.wait(timeout=60)
        while True:
            line = self.q.get(timeout=60)
            if line is None:
                return "".join(self.lines)
            self.lines.append(line)


def tolerant_metrics(path):
    """metrics.jsonl records by step, all of them (a step re-run after a kill appears
    again); a line cut by SIGKILL mid-write is skipped."""
    out = []
    for line in pathlib.Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in rec:
            out.append(rec)
    return out


def check_save_dir(save_dir):
    """`latest` names a complete checkpoint and every step folder is complete; the step
    of the newest one, which --resume takes (`latest` lags it when a kill fell between
    publishing a folder and moving the pointer)."""
    name = (save_dir / "latest").read_text().strip()
    assert (save_dir / name / "manifest.json").is_file(), f"latest -> {name}, which has no manifest.json"
    for p in save_dir.glob("step-*"):
        assert (p / "manifest.json").is_file(), f"{p} published without its manifest"
    newest = max(p.name for p in save_dir.glob("step-*"))
    assert name <= newest
    step = json.loads((save_dir / newest / "manifest.json").read_text())["step"]
    assert newest == f"step-{step:08d}"
    return step


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_sigkill_at_random_moments_while_saving(nnstrain, tiny_tokens, tmp_path, async_save):
    """Asynchronous saves (the default) are killed during the snapshot, the background
    write or the publish; synchronous ones while the step waits for them."""
    common = ["--vars.data", tiny_tokens, *BIG, "--max_train_steps", KILL_STEPS, "--checkpoint.async_save", async_save]
    ref_dir = tmp_path / "reference"
    ref = nnstrain(CONFIG, *common, "--checkpoint.save_dir", ref_dir / "ckpt", run_dir=ref_dir)
    want = {r["step"]: r["loss"] for r in ref.train}
    assert sorted(want) == list(range(1, KILL_STEPS + 1))

    d = tmp_path / "killed"
    save_dir = d / "ckpt"
    saving = ["--checkpoint.save_dir", save_dir, "--checkpoint.every_n_train_steps", 1,
              "--checkpoint.keep_last_n_checkpoints", 2]
    rng = random.Random(20240611)
    latest_step, mid_save = None, 0
    for k in range(KILLS):
        proc = subprocess.Popen(command(1, *common, *saving, run_dir=d, resume=True), cwd=SOURCE,
                                env=single_process_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        out = Lines(proc)
        try:
            if latest_step is not None:
                m = out.wait_for(r"resumed from (\S+) at step (\d+)")
                assert m, f"kill {k}: the process ended before resuming:\n{''.join(out.lines)}"
                assert int(m.group(2)) == latest_step and m.group(1).endswith(f"step-{latest_step:08d}")
            assert out.wait_for(r"saved checkpoint"), f"kill {k}: ended early:\n{''.join(out.lines)}"
            time.sleep(rng.uniform(0.0, 0.4))  # the random moment: most of a step is its save
            proc.send_signal(signal.SIGKILL)
            out.rest()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"kill {k}: the run ended by itself:\n{''.join(out.lines)}"
        mid_save += any(save_dir.glob(".tmp-step-*"))
        latest_step = check_save_dir(save_dir)
        assert latest_step < KILL_STEPS
        assert len(list(save_dir.glob("step-*"))) <= 3  # keep_last 2 (+1 while a save was being published)

    print(f"\n{KILLS} SIGKILLs, {mid_save} of them with a save in progress; last complete step {latest_step}")
    assert mid_save >= KILLS // 4, f"only {mid_save} of {KILLS} kills hit a save in progress: the test lost its aim"

    # The chain ends with an ordinary resumed run to the end.
    final = train(1, *common, *saving[:2], "--checkpoint.every_n_train_steps", 0, run_dir=d, resume=True)
    assert f"at step {latest_step}" in final.output, final.output
    assert check_save_dir(save_dir) == KILL_STEPS
    records = tolerant_metrics(d / "metrics.jsonl")
    assert {r["step"] for r in records} >= set(range(latest_step + 1, KILL_STEPS + 1))
    for r in records:  # every step any resumed process ran, bitwise as the uninterrupted run
        assert r["loss"] == want[r["step"]], f"step {r['step']}: {r['loss']!r} != {want[r['step']]!r}"


# ------------------------------------------------------------------ SIGTERM under the launcher


def children(pid):
    try:
        text = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def rank_of(pid):
    try:
        env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_sigterm_to_one_rank_saves_and_stops(tiny_tokens, tmp_path, sig):
    # SLURM sends SIGTERM at preemption, or SIGUSR1 ahead of the time limit (--signal): the same stop.
    d = tmp_path / "preempted"
    args = command(2, "--vars.data", tiny_tokens, "--checkpoint.save_dir", d / "ckpt", "--max_train_steps", 100000,
                   "--val_every_n_train_steps", 0, run_dir=d)
    proc = subprocess.Popen(args, cwd=SOURCE, env=single_process_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = Lines(proc)
    try:
        assert out.wait_for(r"step 3/100000"), "".join(out.lines)
        workers = {rank_of(p): p for p in children(proc.pid)}
        assert 1 in workers, f"no rank 1 among the launcher's children {workers}"
        os.kill(workers[1], sig)
        text = out.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, text
    assert "stop requested" in text and "stopped early on request" in text, text
    tr, _ = read_metrics(d / "metrics.jsonl")
    last = tr[-1]["step"]
    assert 3 <= last < 100000
    assert check_save_dir(d / "ckpt") == last  # saved at the step it stopped at
    manifest = json.loads((d / "ckpt" / f"step-{last:08d}" / "manifest.json").read_text())
    assert sorted(manifest["rank_states"]) == ["0", "1"]

    again = train(2, "--vars.data", tiny_tokens, "--checkpoint.save_dir", d / "ckpt", "--max_train_steps", last + 2,
                  "--val_every_n_train_steps", 0, run_dir=d, resume=True)
    assert f"at step {last}" in again.output, again.output
    assert [r["step"] for r in again.train][-2:] == [last + 1, last + 2]


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_during_a_long_validation_stops_it(tiny_tokens, tmp_path, nproc):
    # A validation of a million batches at the last step: SIGTERM (to every rank,
    # as a scheduler sends it) ends it within seconds, all ranks together, and the
    # run saves and exits 0 without recording a val loss from part of the batches.
    d = tmp_path / "preempted_eval"
    args = command(nproc, "--vars.data", tiny_tokens, "--checkpoint.save_dir", d / "ckpt", "--max_train_steps", 2,
                   "--val_every_n_train_steps", 2, "--max_val_steps", 1000000, run_dir=d)
    proc = subprocess.Popen(args, cwd=SOURCE, env=single_process_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = Lines(proc)
    try:
        assert out.wait_for(r"step 2/2"), "".join(out.lines)
        time.sleep(1.0)  # well into the validation (it needs minutes)
        t0 = time.monotonic()
        for pid in (list(children(proc.pid)) if nproc > 1 else [proc.pid]):
            os.kill(pid, signal.SIGTERM)
        text = out.rest()
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, text
    assert took < 30, f"SIGTERM took {took:.1f} s to end the validation"
    assert "validation cut short by a stop request" in text and "stopped early on request" in text, text
    assert not [r for r in read_metrics(d / "metrics.jsonl")[1]], "a val loss from part of the batches was recorded"
    assert check_save_dir(d / "ckpt") == 2


# ------------------------------------------------------------------ load faults


@pytest.fixture(scope="module")
def saved(tiny_tokens, tmp_path_factory):
    """A dp=1 checkpoint at step 2."""
    d = tmp_path_factory.mktemp("faults_src")
    train(1, "--vars.data", tiny_tokens, "--checkpoint.save_dir", d / "ckpt", "--max_train_steps", 2, run_dir=d)
    return d / "ckpt" / "step-00000002"


def read_st(path):
    raw = pathlib.Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return raw[8:8 + n].decode(), raw[8 + n:]


def write_st(path, header, data):
    """A safetensors file with `header` (text, written as is) over the data section."""
    h = header.encode()
    h += b" " * (-len(h) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(h)) + h + data)


def entries(header):
    """The header's tensors in data order (name, entry), __metadata__ apart."""
    j = json.loads(header)
    meta = j.pop("__metadata__", None)
    return meta, sorted(j.items(), key=lambda kv: kv[1]["data_offsets"][0])


def header_text(meta, items):
    """Header JSON from (name, entry) pairs, kept as given (duplicates included)."""
    parts = ([f'"__metadata__":{json.dumps(meta)}'] if meta is not None else [])
    parts += [f"{json.dumps(k)}:{json.dumps(v)}" for k, v in items]
    return "{" + ",".join(parts) + "}"


def edit_header(path, fn):
    header, data = read_st(path)
    meta, items = entries(header)
    meta, items, data = fn(meta, items, data)
    write_st(path, header_text(meta, items), data)


def overlap(meta, items, data):
    (n0, e0), (n1, e1) = items[0], items[1]
    size = e1["data_offsets"][1] - e1["data_offsets"][0]
    e1["data_offsets"] = [e0["data_offsets"][0] + 4, e0["data_offsets"][0] + 4 + size]
    return meta, items, data


def duplicate(meta, items, data):
    return meta, [items[0]] + items, data


def unknown_dtype(meta, items, data):
    items[0][1]["dtype"] = "F33"
    return meta, items, data


def edit_manifest(ckpt, fn):
    p = ckpt / "manifest.json"
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def set_dtype(m, name, dtype):
    for es in m["files"].values():
        for e in es:
            if e["name"] == name:
                e["dtype"] = dtype


SHARD = "rank-00000.safetensors"
FAULTS = {
    # name: (mutation of the copied checkpoint folder, extra overrides, what the message must say)
    "no_manifest": (lambda c: (c / "manifest.json").unlink(), [], ["manifest.json missing"]),
    "missing_shard": (lambda c: (c / SHARD).unlink(), [], [SHARD, "is missing"]),
    "other_shape": (lambda c: None, ["--model.args.n_embd", 48],
                    [SHARD, "model/", "in the checkpoint but", "in the model"]),
    # Floating types convert on load (a bf16-true checkpoint resumes under 32-true); an integer type never.
    "dtype_mismatch": (lambda c: edit_manifest(c, lambda m: set_dtype(m, "model/wte.weight", "I64")), [],
                       [SHARD, "model/wte.weight", "dtype I64 in the checkpoint but F32 in the model"]),
    "other_model": (lambda c: edit_manifest(c, lambda m: m["state"].update(model_type="llama")), [],
                    ["checkpoint of model type 'llama'", "trains 'gpt'"]),
    "truncated": (lambda c: (c / SHARD).write_bytes((c / SHARD).read_bytes()[:-7]), [], [SHARD, "truncated"]),
    "header_beyond_file": (lambda c: (c / SHARD).write_bytes(
        struct.pack("<Q", (c / SHARD).stat().st_size) + (c / SHARD).read_bytes()[8:]), [],
        [SHARD, "header length", "exceeds the file"]),
    "overlapping_offsets": (lambda c: edit_header(c / SHARD, overlap), [], [SHARD, "overlap"]),
    "duplicate_names": (lambda c: edit_header(c / SHARD, duplicate), [], [SHARD, "duplicate tensor name"]),
    "unknown_dtype": (lambda c: edit_header(c / SHARD, unknown_dtype), [], [SHARD, "unknown dtype 'F33'"]),
    "trailing_bytes": (lambda c: (c / SHARD).write_bytes((c / SHARD).read_bytes() + b"\0" * 16), [],
                       [SHARD, "16 trailing bytes"]),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_load_fault_is_a_clear_error(saved, tiny_tokens, tmp_path, fault):
    mutate, extra, expect = FAULTS[fault]
    ckpt = tmp_path / "ckpt" / "step-00000002"
    shutil.copytree(saved, ckpt)
    mutate(ckpt)
    run = train(1, "--vars.data", tiny_tokens, "--checkpoint.save_dir", tmp_path / "new", "--max_train_steps", 4,
                *extra, run_dir=tmp_path, resume=ckpt, check=False)
    assert run.returncode == 1, f"exit status {run.returncode} (1 = an error, not a crash):\n{run.output}"
    for text in expect:
        assert text in run.output, f"{fault}: {text!r} not in the error:\n{run.output}"
    assert "step 1/" not in run.output  # nothing trained
