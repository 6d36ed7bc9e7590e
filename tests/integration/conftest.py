"""Shared fixtures of the integration tests: they drive the nnstrain binary.

- nnstrain_bin: the binary under test (NNSTRAIN_BIN, set by CTest).
- write_token_file / tiny_tokens: a small nanoGPT-format token file (uint16) with
  learnable structure, so a few dozen steps of a tiny GPT lower the loss.
- run_dir: an empty temporary folder for one run's metrics and checkpoints.
- nnstrain: a runner: nnstrain(config, *overrides, resume=...) launches the binary
  as a single process and returns a Run with its exit status, output and the
  parsed metrics.jsonl.

- device_args(nproc): the overrides that put a training run on the test device.

Environment: NNSTRAIN_BIN, NNSTRAIN_SOURCE_DIR (both set by tests/CMakeLists.txt);
NNSTRAIN_TEST_DEVICE = cpu (default) or cuda: the device of the tests labelled
`device` in CTest (`NNSTRAIN_TEST_DEVICE=cuda ctest -L device` on a GPU machine;
see tests/README.md).
"""
import dataclasses
import json
import os
import pathlib
import re
import subprocess

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = pathlib.Path(os.environ.get("NNSTRAIN_SOURCE_DIR", HERE.parents[1]))
CONFIGS = HERE / "configs"

# A launcher's variables on the machine running the tests must not turn a
# single-process run into a rank of some other job.
_LAUNCH_PREFIXES = ("SLURM_", "PBS_", "PALS_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
TEST_DEVICE = os.environ.get("NNSTRAIN_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"NNSTRAIN_TEST_DEVICE={TEST_DEVICE!r}: expected cpu or cuda")

_LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}


def write_token_file(path, n_tokens=20000, vocab=64, seed=0):
    """A uint16 token file drawn from a sparse random Markov chain over `vocab` ids
    (each id has 3 likely successors), so next-token loss can fall well below log(vocab)."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab, size=(vocab, 3))
    probs = np.array([0.6, 0.25, 0.15])
    out = np.empty(n_tokens, dtype=np.uint16)
    t = 0
    choices = rng.choice(3, size=n_tokens, p=probs)
    noise = rng.random(n_tokens) < 0.05
    uniform = rng.integers(0, vocab, size=n_tokens)
    for i in range(n_tokens):
        t = uniform[i] if noise[i] else succ[t, choices[i]]
        out[i] = t
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out.astype("<u2").tofile(path)
    return path


@pytest.fixture(scope="session")
def tiny_tokens(tmp_path_factory):
    """Path of a 20k-token file over a vocabulary of 64 (shared by the session's tests)."""
    return write_token_file(tmp_path_factory.mktemp("data") / "tokens.bin")


def splitmix64(x):
    """splitmix64's finaliser, as base/hash.h: the data streams' counter-based arithmetic."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def train_window_starts(n_tokens, seed, step, count, seq_len):
    """Where the `count` samples of a token_bin's data step `step` start (data/token_bin.cpp window_start)."""
    return [splitmix64(splitmix64(splitmix64(seed) ^ step) ^ pos) % (n_tokens - seq_len) for pos in range(count)]


def nnstrain_bin_path():
    path = os.environ.get("NNSTRAIN_BIN")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"NNSTRAIN_BIN={path!r} is not an executable nnstrain binary (build the nnstrain target)")
    return path


@pytest.fixture
def nnstrain_bin():
    return nnstrain_bin_path()


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


def read_metrics(path):
    """metrics.jsonl as (train records, val records), each a list of dicts in file order."""
    train, val = [], []
    path = pathlib.Path(path)
    if not path.exists():
        return train, val
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "eval_seconds" in rec:  # an eval: section's task scores (test_eval.py reads them)
            continue
        (val if "val_loss" in rec else train).append(rec)
    return train, val


@dataclasses.dataclass
class Run:
    args: list
    returncode: int
    stdout: str
    stderr: str
    train: list  # metrics.jsonl training records (step, loss, lr, grad_norm, tokens_per_s, ...)
    val: list    # metrics.jsonl validation records (step, val_loss)

    @property
    def output(self):
        return self.stdout + self.stderr

    def losses(self):
        """{step: loss} of the training records; a step logged twice is an error."""
        out = {}
        for r in self.train:
            assert r["step"] not in out, f"step {r['step']} logged twice in metrics.jsonl"
            out[r["step"]] = r["loss"]
        return out


def device_args(nproc=1):
    """Overrides that run a training job of `nproc` ranks on TEST_DEVICE: the CPU, or
    CUDA (one rank: NCCL were there peers; several ranks: Gloo on CUDA tensors,
    sharing the GPUs there are through NNSTRAIN_SHARE_DEVICES, see single_process_env)."""
    if TEST_DEVICE == "cpu":
        return ["--compute_config.device", "cpu"]
    return ["--compute_config.device", "cuda", "--compute_config.backend", "nccl" if nproc == 1 else "gloo"]


def single_process_env(threads=1, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = str(threads)
    if TEST_DEVICE == "cuda":
        env["NNSTRAIN_SHARE_DEVICES"] = "1"  # several test ranks on a machine's one GPU
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="session")
def nnstrain():
    """nnstrain(config, *overrides, run_dir=..., resume=None, check=True, cwd=None, timeout=240, threads=1) -> Run.

    `config` is a path or the name of a file in tests/integration/configs/; `run_dir`
    sets --run_dir (metrics go to <run_dir>/metrics.jsonl); `resume` is None (no
    flag), True (bare --resume) or a path (--resume PATH). With check=True a
    non-zero exit fails the test with the run's output. Session-scoped, so
    module-scoped fixtures can share expensive runs."""
    binary = nnstrain_bin_path()

    def run(config, *overrides, run_dir, resume=None, check=True, cwd=None, timeout=240, threads=1):
        config = pathlib.Path(config)
        if not config.is_absolute():
            config = CONFIGS / config
        args = [binary, "--config", str(config), "--run_dir", str(run_dir), *device_args(1)]
        args += [str(o) for o in overrides]
        if resume is True:
            args.append("--resume")
        elif resume is not None:
            args += ["--resume", str(resume)]
        p = subprocess.run(args, cwd=cwd or SOURCE, env=single_process_env(threads), capture_output=True,
                           text=True, timeout=timeout)
        train, val = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
        result = Run(args, p.returncode, p.stdout, p.stderr, train, val)
        if check and p.returncode != 0:
            pytest.fail(f"nnstrain exited with {p.returncode}: {' '.join(args)}\n{result.output}")
        return result
    return run


# --- The feature under test was on ------------------------------------------
# A parity test compares a parallel run with one process; it means something
# only if the parallel side really ran what it was asked to (a use_zero: 2 run
# silently as stage 1 would match one process just as well). assert_active()
# checks that from the direct evidence each feature leaves: the run's record of
# what ran (run_dir/active/rank<R>.json, written by each rank from the objects
# it built and completed with counts taken in the code that ran its first step:
# process groups, ZeRO stage, pipeline, loss, kernels, reduce dtype;
# docs/observability.md), the bytes each rank holds between steps (ZeRO
# stages), the collectives counted on the tensor-parallel group (TP, and SP by
# its reduce-scatters), and the element sizes of the state (precision).

# Bytes per parameter element before any sharding: (param, grad, master, moments),
# compute_config.reduce_dtype left at auto. docs/precision.md.
STATE_ELEMENT_BYTES = {
    "32-true": (4, 4, 0, 8),
    "bf16-mixed": (2, 4, 4, 8), "16-mixed": (2, 4, 4, 8),
    "bf16-true": (2, 2, 0, 4), "16-true": (2, 2, 0, 4),
}
_PRECISION_ALIASES = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
# The record's dtype names: a precision's parameters, and a reduce_dtype's.
PARAM_DTYPE = {"32-true": "float32", "bf16-mixed": "bfloat16", "16-mixed": "float16", "bf16-true": "bfloat16",
               "16-true": "float16"}
REDUCE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def active_records(run_dir, nproc):
    """{rank: record}: what each of the `nproc` ranks recorded it ran (run_dir/active/rank<R>.json,
    trainer/train/active_record.h), every rank's file present and completed by a first step."""
    out = {}
    for rank in range(nproc):
        path = pathlib.Path(run_dir) / "active" / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no record of what ran ({path})"
        rec = json.loads(path.read_text())
        assert rec["rank"] == rank and rec["world_size"] == nproc, f"{path}: rank {rec['rank']} of {rec['world_size']}"
        assert "first_step" in rec, f"{path}: no first step recorded: {rec}"
        out[rank] = rec
    return out


def loss_ran(records, kind):
    """Asserts that in the first step only the `kind` loss ran forward, on every rank that computed a loss
    (under pp the last stage's), once per micro-batch; returns how many ranks ran it."""
    ran = 0
    for rank, rec in records.items():
        fwd = rec["first_step"]["loss_forwards"]
        if not any(fwd.values()):
            continue
        ran += 1
        micros = rec["pipeline"]["nmicros"] if rec["pipeline"] else rec["micro_batches_per_step"]
        want = {k: (micros if k == kind else 0) for k in fwd}
        assert rec["loss"]["kind"] == kind and fwd == want, \
            f"rank {rank}: asked for the {kind} loss, built {rec['loss']['kind']!r}, its forwards ran {fwd}"
    assert ran, f"no rank ran a loss forward: {records}"
    return ran


def rank_log_numbers(run_dir, nproc, pattern):
    """{rank: (int, ...)}: the groups of `pattern` in each rank's log (run_dir/logs/rankN.log),
    which every rank must have."""
    found = {}
    for rank in range(nproc):
        log = (pathlib.Path(run_dir) / "logs" / f"rank{rank}.log").read_text()
        m = re.search(pattern, log)
        assert m, f"rank {rank}: no line matching {pattern!r} in its log:\n{log}"
        found[rank] = tuple(map(int, m.groups()))
    return found


def held_between_steps(run_dir, nproc):
    """{rank: {"param", "grad", "master", "moments", "elements"}}: the bytes each rank keeps between
    steps, and its parameter elements before ZeRO (after tensor parallelism), from its log."""
    found = rank_log_numbers(run_dir, nproc, r"held between steps: parameters (\d+), gradients (\d+), masters (\d+), "
                                             r"optimizer moments (\d+) bytes, for (\d+) parameter elements")
    return {r: dict(zip(("param", "grad", "master", "moments", "elements"), v)) for r, v in found.items()}


def _override(overrides, key, default=None):
    overrides = [str(o) for o in overrides]
    for i, o in enumerate(overrides):
        if o == key and i + 1 < len(overrides):
            return overrides[i + 1]
        if o.startswith(key + "="):
            return o.split("=", 1)[1]
    return default


def expected_plan(nproc, overrides):
    """What the command line asks for: tp, cp (and its comm type), pp (and its scheduler), dp, ZeRO stage,
    ZeRO shard group size (a slice of dp x cp), SP, recompute, precision, reduce dtype."""
    tp = int(_override(overrides, "--compute_config.plan_ngpus", 1))
    if _override(overrides, "--pas_policy") == "dp":
        tp = 1
    cp = int(_override(overrides, "--compute_config.context_parallel_size", 1))
    pp = int(_override(overrides, "--compute_config.pas_config.pp_size", 1))
    zero = _override(overrides, "--compute_config.use_zero", "0")
    zero = {"true": 1, "false": 0}.get(zero, zero)
    dp = nproc // (tp * cp * pp)
    ngroups = int(_override(overrides, "--compute_config.zero_ngroups", 1))
    precision = _override(overrides, "--precision", "32-true")
    precision = _PRECISION_ALIASES.get(precision, precision)
    reduce = _override(overrides, "--compute_config.reduce_dtype", "auto")
    reduce = REDUCE_DTYPE.get(reduce) or ("float32" if precision.endswith("-mixed") else PARAM_DTYPE[precision])
    return {"tp": tp, "cp": cp, "cp_comm": _override(overrides, "--compute_config.cp_comm_type", "p2p"),
            "ep": int(_override(overrides, "--compute_config.expert_parallel_size", 1)),
            "pp": pp, "scheduler": _override(overrides, "--compute_config.pas_config.pipeline_scheduler", "1f1b"),
            "dp": dp, "zero": int(zero), "zero_group": dp * cp // ngroups,
            "sp": tp > 1 and _override(overrides, "--compute_config.sequence_parallel", "true") == "true",
            "recompute": _override(overrides, "--model.activation_checkpointing", "false") == "true",
            "precision": precision, "reduce_dtype": reduce}


def assert_active(run_dir, output, nproc, overrides):
    """Asserts that the run in `run_dir` (its log text `output`, `nproc` processes)
    ran the parallelism and precision its `overrides` asked for, from direct evidence."""
    want = expected_plan(nproc, overrides)
    run_dir = pathlib.Path(run_dir)
    records = active_records(run_dir, nproc)
    layers = len(json.loads((run_dir / "plan.json").read_text())["recompute"])
    for rank, rec in records.items():
        got = {k: rec["groups"][k]["size"] for k in ("tp", "cp", "pp", "dp")}
        got["zero"] = rec["zero_stage"]
        assert got == {k: want[k] for k in got}, f"rank {rank} ran {got}, the command line asked for {want}"
        if want["zero"] and want["zero_group"] > 1:
            assert rec["groups"]["zero"]["size"] == want["zero_group"], f"rank {rank}: ZeRO group {rec['groups']}"
        assert rec["dtypes"]["params"] == PARAM_DTYPE[want["precision"]], f"rank {rank}: {rec['dtypes']}"
        assert rec["recompute_layers"] == (layers if want["recompute"] else 0), \
            f"rank {rank}: recompute {'asked' if want['recompute'] else 'not asked'}, the model recomputes " \
            f"{rec['recompute_layers']} of {layers} layers"
        step = rec["first_step"]
        if want["ep"] > 1:  # each rank held 1/ep of the experts and tokens travelled by all-to-all
            experts = rec["experts"]
            assert rec["groups"]["ep"]["size"] == want["ep"] and experts and experts["own_buckets"], \
                f"rank {rank}: expert parallelism {want['ep']} asked, it ran {rec['groups']['ep']}, experts {experts}"
            assert experts["held_elements"] * want["ep"] == experts["global_elements"], \
                f"rank {rank}: holds {experts['held_elements']} of {experts['global_elements']} expert elements"
            if want["zero"] and want["zero_group"] > 1:  # experts ZeRO-sharded within the ZeRO group (HSDP too)
                assert rec["groups"]["ezero"]["size"] == want["zero_group"] // want["ep"], \
                    f"rank {rank}: expert ZeRO group {rec['groups']['ezero']}, want {want['zero_group'] // want['ep']}"
            assert step["ep_all_to_all"] > 0 and step["ep_bytes"] > 0, f"rank {rank}: no all-to-all: {step}"
        # The gradients were reduced over dp x cp, in the dtype asked for (none is reduced without replicas).
        reduced = want["reduce_dtype"] if want["dp"] * want["cp"] > 1 else None
        assert step["reduce_dtype"] == reduced, f"rank {rank}: gradients reduced in {step['reduce_dtype']}, want {reduced}"
        if want["pp"] > 1:
            pipe = rec["pipeline"]
            assert pipe and pipe["scheduler"] == want["scheduler"] and pipe["pp_rank"] == rec["groups"]["pp"]["rank"], \
                f"rank {rank}: pp {want['pp']} {want['scheduler']} asked, its pipeline: {pipe}"
            assert step["micro_batches"] == pipe["nmicros"] and step["pp_sends"] > 0, \
                f"rank {rank}: no pipeline transfers in its first step: {step}"
        else:
            assert rec["pipeline"] is None, f"rank {rank}: pp 1 asked, it ran a pipeline: {rec['pipeline']}"
    # Every micro-batch reached the loss: once per micro-batch on each rank holding the last stage
    # (every rank without pp), and on no other.
    holders = loss_ran(records, records[0]["loss"]["kind"])
    assert holders == nproc // want["pp"], f"{holders} ranks computed the loss, want {nproc // want['pp']}"

    # Bytes held: what each stage shards over its group of z ranks (padding: a few elements per unit).
    eb = dict(zip(("param", "grad", "master", "moments"), STATE_ELEMENT_BYTES[want["precision"]]))
    stage, z = want["zero"], want["zero_group"]
    for rank, held in held_between_steps(run_dir, nproc).items():
        full = {k: held["elements"] * b for k, b in eb.items()}
        # Under expert parallelism experts shard over the z / ep ranks holding the same ones.
        experts = records[rank]["experts"]["held_elements"] if want["ep"] > 1 else 0
        # AdamW holds two moments per element; another optimizer (Muon: one momentum for its
        # matrices) holds less, so its moments are checked against AdamW's as a bound.
        adamw = set(records[rank]["optimizer"]["state_segments"]) <= {"exp_avg", "exp_avg_sq"}
        def sharded(part, on):
            if part == "moments" and not adamw:
                assert 0 < held[part] < full[part], f"rank {rank}: {part} {held[part]} bytes, AdamW's {full[part]}"
            elif not on or z == 1:  # whole, in the precision's dtype: n elements of it, plus the flat
                # layout's 16-element alignment (under 16 per tensor and bucket; the tests' models hold < 256)
                pad = held[part] - full[part]
                assert 0 <= pad <= 16 * 256 * eb[part], \
                    f"rank {rank}: {part} {held[part]} bytes, whole is {full[part]} ({held})"
            else:
                slack = 64 * z * eb[part]
                share = ((held["elements"] - experts) / z + experts * want["ep"] / z) * eb[part]
                assert held[part] <= share + slack, \
                    f"rank {rank}: ZeRO-{stage} over {z} ranks, {part} {held[part]} bytes, want 1/{z} of {full[part]}"
        sharded("param", stage >= 3)
        sharded("master", stage >= 1)
        sharded("moments", stage >= 1)
        if stage >= 2 and z > 1:  # a reduced shard, plus at most a few pooled bucket buffers: below the whole
            assert held["grad"] < full["grad"], f"rank {rank}: ZeRO-{stage} holds whole gradients ({held})"
        else:  # whole (ZeRO-1 adds the reduce-scatter's shard)
            assert held["grad"] >= full["grad"], f"rank {rank}: gradients {held['grad']}, whole is {full['grad']}"

    train, _ = read_metrics(run_dir / "metrics.jsonl")
    assert train, f"no training records in {run_dir / 'metrics.jsonl'}"
    last = train[-1]
    if want["dp"] * want["cp"] > 1:  # gradients are reduced over dp x cp
        assert last.get("dp_comm_mb_per_step", 0) > 0, f"dp {want['dp']} x cp {want['cp']}: no gradient traffic: {last}"
    if want["cp"] > 1:
        # The ring (p2p) or the K/V gather (all_gather) ran on the context-parallel group.
        ops = last.get("cp_collectives_per_step")
        assert ops and last["cp_comm_mb_per_step"] > 0, f"cp {want['cp']}: no context-parallel traffic: {last}"
        kind = "send_recv" if want["cp_comm"] == "p2p" else "all_gather"
        assert ops[kind] > 0, f"cp_comm_type {want['cp_comm']}: no {kind} on the cp group: {ops}"
    if want["tp"] > 1:
        ops = last.get("tp_collectives_per_step")
        assert ops and last["tp_comm_mb_per_step"] > 0, f"tp {want['tp']}: no tensor-parallel traffic: {last}"
        # Sequence parallelism reduce-scatters after every row-parallel linear; plain TP all-reduces.
        if want["sp"]:
            assert ops["reduce_scatter"] > 0, f"sequence parallelism asked, no reduce-scatter: {ops}"
        else:
            assert ops["reduce_scatter"] == 0 and ops["all_reduce"] > 0, f"sequence parallelism off: {ops}"
    assert_precision(output, want["precision"])
    return want


def run_ranks(ranks, run_dir, args, overrides):
    """nnstrain `args` (which include `overrides`) on `ranks` processes, through `nnstrain launch`
    when > 1; asserts it exits 0 and ran the plan `overrides` ask for (assert_active). Returns
    {step: (loss, grad_norm)} of its metrics.jsonl."""
    binary = nnstrain_bin_path()
    cmd = [binary, *args] if ranks == 1 else [binary, "launch", "--nproc-per-node", str(ranks), "--", *args]
    p = subprocess.run(cmd, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}"
    assert_active(run_dir, p.stdout + p.stderr, ranks, overrides)  # the plan compared really ran
    train, _ = read_metrics(pathlib.Path(run_dir) / "metrics.jsonl")
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in train}


def assert_precision(output, precision):
    """The run says it trained in `precision` (the bytes it held tell the dtypes: assert_active)."""
    m = re.search(r"precision (\S+): state bytes/param", output)
    assert m, f"no precision line in the output:\n{output}"
    assert m.group(1) == precision, f"ran {m.group(1)}, asked {precision}"
