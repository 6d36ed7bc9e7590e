"""Data parallelism is exact: for the same seed and global batch, every split of
the batch over ranks, micro-batches and accumulation steps gives the losses of one
process, and every ZeRO stage (1, 2, 3, hybrid sharding, ZeRO-3 with tensor and
sequence parallelism, with recompute, with accumulation) gives the losses of one
process (DESIGN.md, "Parity is the correctness test of a parallel trainer").

Runs: a tiny GPT (configs/tiny_dp.yaml: 2 layers, n_embd 32, 32-token samples, a
0.01 MB bucket cap so there are several buckets, clip_gnorm below the gradient
norms at some steps, so clipping is active) for 10 steps on the shared generated
token file, one thread per process; dp > 1 through `nnstrain launch` with Gloo.
Gradient norms must agree as well (clipping and Adam hide a wrong gradient
scale from the losses). Each comparison
asserts the loss of all 10 steps within 1e-5 relative and records the largest
relative difference (printed with -s, and written to parity.json in the module's
temporary folder).

Also: rank 0 logs the loss averaged over ranks and tokens/s of the whole job.
"""
import json
import os
import re
import pathlib
import subprocess

import pytest

from conftest import assert_active, device_args, held_between_steps, single_process_env

HERE = pathlib.Path(__file__).resolve().parent
CONFIG = HERE / "configs" / "tiny_dp.yaml"
SOURCE = pathlib.Path(os.environ.get("NNSTRAIN_SOURCE_DIR", HERE.parents[1]))
STEPS, SEQ_LEN, MICRO, CLIP = 10, 32, 4, 0.95
RTOL = 1e-5

# name: (processes, micro batch, accumulation steps, extra overrides)
RUNS = {
    "dp1_b4": (1, MICRO, 1, ()),
    "dp1_b8": (1, 2 * MICRO, 1, ()),
    "dp1_b4_acc2": (1, MICRO, 2, ()),
    "dp2_b4": (2, MICRO, 1, ()),
    "dp2_b4_zero": (2, MICRO, 1, ("--compute_config.use_zero", "true")),
    "dp1_b16": (1, 4 * MICRO, 1, ()),
    "dp1_b4_acc4": (1, MICRO, 4, ()),
    "dp4_b4": (4, MICRO, 1, ()),
    "dp4_b4_zero": (4, MICRO, 1, ("--compute_config.use_zero", "true")),
    "dp4_b4_zero_ng2": (4, MICRO, 1, ("--compute_config.use_zero", "true", "--compute_config.zero_ngroups", "2")),
    "dp2_b4_acc2": (2, MICRO, 2, ()),
    "dp2_b4_acc2_zero": (2, MICRO, 2, ("--compute_config.use_zero", "true")),
    "dp2_b4_zero2": (2, MICRO, 1, ("--compute_config.use_zero", "2")),
    "dp2_b4_acc2_zero2": (2, MICRO, 2, ("--compute_config.use_zero", "2")),
    "dp2_b4_zero3": (2, MICRO, 1, ("--compute_config.use_zero", "3")),
    "dp4_b4_zero3": (4, MICRO, 1, ("--compute_config.use_zero", "3")),
    "dp4_b4_zero1": (4, MICRO, 1, ("--compute_config.use_zero", "1")),
    "dp4_b4_zero3_ng2": (4, MICRO, 1, ("--compute_config.use_zero", "3", "--compute_config.zero_ngroups", "2")),
    "dp2_b4_acc2_zero3": (2, MICRO, 2, ("--compute_config.use_zero", "3")),
    "dp2_b4_zero3_recompute": (2, MICRO, 1, ("--compute_config.use_zero", "3", "--model.activation_checkpointing", "true",
                                             "--compute_config.zero_prefetch", "2")),
    # 4 ranks = tp 2 x dp 2, sequence parallelism on (the default at tp > 1): global batch 8.
    "tp2_dp2_b4_zero3": (4, MICRO, 1, ("--compute_config.use_zero", "3", "--pas_policy", "hybrid",
                                       "--compute_config.plan_ngpus", "2")),
}

# (run, reference): same global batch, so the same samples at every step.
# The timing test's runs: the same plans with a model wide enough that a
# step takes tens of milliseconds, so that the scheduler's time slices (a
# few ms, taken from whichever process when the machine is busy) fall inside
# and outside the timed step in proportion, not at random.
WIDE_SUFFIX, WIDE = "_wide", ("--model.args.n_embd", "192")

COMPARISONS = [
    ("dp2_b4", "dp1_b8"),
    ("dp1_b4_acc2", "dp1_b8"),
    ("dp2_b4", "dp1_b4_acc2"),
    ("dp2_b4_zero", "dp2_b4"),
    ("dp4_b4", "dp1_b16"),
    ("dp4_b4", "dp1_b4_acc4"),
    ("dp4_b4_zero", "dp4_b4"),
    ("dp4_b4_zero_ng2", "dp4_b4"),
    ("dp2_b4_acc2", "dp1_b16"),
    ("dp2_b4_acc2", "dp4_b4"),
    ("dp2_b4_acc2_zero", "dp2_b4_acc2"),
    ("dp2_b4_zero2", "dp1_b8"),
    ("dp2_b4_acc2_zero2", "dp1_b16"),
    ("dp2_b4_zero3", "dp1_b8"),
    ("dp4_b4_zero3", "dp1_b16"),
    ("dp4_b4_zero3_ng2", "dp1_b16"),
    ("dp2_b4_acc2_zero3", "dp1_b16"),
    ("dp2_b4_zero3_recompute", "dp1_b8"),
    ("tp2_dp2_b4_zero3", "dp1_b8"),
]


def metrics(run_dir):
    recs = []
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if path.exists():
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if "loss" in r]


class Job:
    def __init__(self, name, nproc, micro, accum, proc, records, tp=1):
        self.name, self.nproc, self.micro, self.accum = name, nproc, micro, accum
        self.output = proc.stdout + proc.stderr
        self.records = records
        self.global_batch = nproc // tp * micro * accum  # tensor-parallel ranks share their samples

    def by_step(self, key):
        out = {}
        for r in self.records:
            assert r["step"] not in out, f"{self.name}: step {r['step']} logged twice in metrics.jsonl"
            out[r["step"]] = r[key]
        return out


@pytest.fixture(scope="module")
def job(tiny_tokens, tmp_path_factory):
    """job(name) -> Job: the run RUNS[name], made once per module."""
    nnstrain_bin = os.environ.get("NNSTRAIN_BIN")
    if not nnstrain_bin or not os.access(nnstrain_bin, os.X_OK):
        pytest.fail(f"NNSTRAIN_BIN={nnstrain_bin!r} is not an executable nnstrain binary (build the nnstrain target)")
    cache = {}

    def get(name):
        if name not in cache:
            base = name.removesuffix(WIDE_SUFFIX)
            nproc, micro, accum, extra = RUNS[base]
            if base != name:
                extra = (*extra, *WIDE)
            run_dir = tmp_path_factory.mktemp(name)
            train = ["--config", str(CONFIG), "--vars.data", str(tiny_tokens), "--run_dir", str(run_dir),
                     "--micro_batch_size", str(micro), "--grad_accumulation_steps", str(accum),
                     "--max_train_steps", str(STEPS), *device_args(nproc), *extra]
            args = [nnstrain_bin, *train] if nproc == 1 else \
                [nnstrain_bin, "launch", "--nproc-per-node", str(nproc), "--", *train]
            p = subprocess.run(args, cwd=SOURCE, env=single_process_env(1), capture_output=True, text=True, timeout=150)
            if p.returncode != 0:
                pytest.fail(f"{name}: exited with {p.returncode}: {' '.join(args)}\n{p.stdout}{p.stderr}")
            tp = int(extra[extra.index("--compute_config.plan_ngpus") + 1]) if "--compute_config.plan_ngpus" in extra else 1
            j = Job(name, nproc, micro, accum, p, metrics(run_dir), tp)
            j.run_dir = pathlib.Path(run_dir)
            assert sorted(j.by_step("loss")) == list(range(1, STEPS + 1)), f"{name}: {j.output}"
            if nproc > 1 and "--pas_policy" not in extra:
                assert f"world {nproc} (dp {nproc})" in j.output, j.output
            # Every comparison below means something only if this run did what it was asked.
            assert_active(run_dir, j.output, nproc, extra)
            cache[name] = j
        return cache[name]
    return get


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    """Largest relative loss difference per comparison, kept in parity.json."""
    path = tmp_path_factory.mktemp("figures") / "parity.json"
    table = {}

    def record(key, value):
        table[key] = value
        path.write_text(json.dumps(table, indent=1, sort_keys=True))
        print(f"\n{key}: {value}   ({path})")
    return record


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("name,ref", COMPARISONS, ids=[f"{a}=={b}" for a, b in COMPARISONS])
def test_losses_match(job, figures, name, ref):
    got, want = job(name), job(ref)
    assert got.global_batch == want.global_batch
    gl, wl = got.by_step("loss"), want.by_step("loss")
    diffs = {s: rel(gl[s], wl[s]) for s in range(1, STEPS + 1)}
    gn = got.by_step("grad_norm")
    wn = want.by_step("grad_norm")
    gn_diff = max(rel(gn[s], wn[s]) for s in range(1, STEPS + 1))
    worst = max(diffs.values())
    figures(f"{name} vs {ref}", {"max_rel_loss_diff": worst, "max_rel_grad_norm_diff": gn_diff,
                                 "worst_step": max(diffs, key=diffs.get)})
    bad = {s: (gl[s], wl[s], d) for s, d in diffs.items() if d > RTOL}
    assert not bad, f"{name} vs {ref}: steps whose losses differ by more than {RTOL} relative: {bad}"
    # Clipping and Adam are blind to the gradients' scale (a missing 1/dp would not
    # move the losses), so the gradient norms must agree too.
    bad = {s: (gn[s], wn[s]) for s in gn if rel(gn[s], wn[s]) > RTOL}
    assert not bad, f"{name} vs {ref}: steps whose grad norms differ by more than {RTOL} relative: {bad}"
    # The comparison means something: training moved the loss, and clipping acted.
    assert gl[STEPS] < gl[1] - 0.05
    assert any(v > CLIP for v in gn.values()), f"{name}: grad_norm never above clip_gnorm {CLIP}: {gn}"


def test_clipping_active_in_every_run(job):
    for name in RUNS:
        norms = job(name).by_step("grad_norm")
        clipped = [s for s, v in norms.items() if v > CLIP]
        # Active at some steps (the norm exceeds clip_gnorm), so clipped updates are part of what is compared.
        assert clipped, f"{name}: clip_gnorm {CLIP} above every grad norm {norms}"


def test_rank0_logs_the_loss_averaged_over_ranks(job):
    # Rank 0 of dp2_b4 holds global-batch positions 0-3 of each step, exactly what
    # dp1_b4 trains on: at step 1 (same initial weights) its own loss is dp1_b4's.
    # What it logs must be the mean over both ranks, i.e. dp1_b8's, not its own.
    dp2, own, both = job("dp2_b4").by_step("loss"), job("dp1_b4").by_step("loss"), job("dp1_b8").by_step("loss")
    # Apart by several times the parity tolerance, so logging rank 0's own loss would fail.
    assert rel(own[1], both[1]) > 5 * RTOL, "the two halves of the batch have the same loss: the test cannot tell"
    assert rel(dp2[1], both[1]) <= RTOL and rel(dp2[1], own[1]) > 5 * RTOL, (dp2[1], own[1], both[1])


STEP_LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})\] (?:\[rank 0\] )?\[info\] step (\d+)/")


@pytest.mark.parametrize("name", ["dp1_b8", "dp2_b4", "dp4_b4", "dp2_b4_acc2", "dp4_b4_zero_ng2"])
def test_tokens_per_s_counts_the_whole_job(job, name):
    import datetime
    j = job(name + WIDE_SUFFIX)
    tokens = j.global_batch * SEQ_LEN
    assert f"global batch {j.global_batch} x {SEQ_LEN} tokens" in j.output, j.output
    # Checked against another clock: the timestamps of rank 0's progress lines.
    # The time the records claim for steps a+1..b (the whole job's tokens per
    # step over tokens_per_s) must be what the log's clock saw pass between the
    # lines of steps a and b, less only the logging and whatever stalled the
    # process outside the step (another job on the machine). Counting one rank's
    # tokens, or one micro-batch's, claims 2x or more the time the log saw:
    # never more than it saw, over the whole run. Counting twice claims half or
    # less of it in every stretch: the claim stays near what the log saw over at
    # least one stretch of 4 steps (a stall lengthens some, not all; the log's
    # millisecond stamps are why 4).
    stamps = {}
    for m in STEP_LINE.finditer(j.output):
        stamps[int(m.group(2))] = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f")
    assert sorted(stamps) == list(range(1, STEPS + 1)), j.output
    tps = j.by_step("tokens_per_s")

    def claimed(a, b):
        return sum(tokens / tps[s] for s in range(a + 1, b + 1))

    def seen(a, b):
        return (stamps[b] - stamps[a]).total_seconds()

    assert claimed(1, STEPS) <= seen(1, STEPS) + 0.002, (
        f"{name}: tokens_per_s says steps 2-{STEPS} took {claimed(1, STEPS) * 1e3:.1f} ms; "
        f"the log saw {seen(1, STEPS) * 1e3:.1f} ms")
    best = max((claimed(a, b) / max(seen(a, b), 1e-3), a, b)
               for a in range(1, STEPS) for b in range(a + 4, STEPS + 1))
    print(f"{name}: best {best}")
    assert best[0] >= 0.7, (
        f"{name}: over every stretch of 4 or more steps tokens_per_s claims at most {best[0]:.2f} of the time the "
        f"log saw (steps {best[1] + 1}-{best[2]})")


@pytest.mark.parametrize("name", ["dp2_b4", "dp4_b4_zero_ng2"])
def test_several_buckets(job, name):
    # Overlap and bucket ordering are only exercised with more than one bucket.
    out = job(name).output
    marker = " buckets"
    line = next((l for l in out.splitlines() if "parameters" in l and marker in l), None)
    assert line is not None, out
    count = int(line[:line.index(marker)].rsplit(" ", 1)[-1])
    assert count >= 3, line


def held_total(j):
    """Per rank: bytes of parameters, gradients, masters and moments it keeps between steps."""
    return {rank: sum(v for k, v in parts.items() if k != "elements")
            for rank, parts in held_between_steps(j.run_dir, j.nproc).items()}


def test_zero3_holds_one_nth_of_the_state(job):
    # fp32 AdamW: 16 bytes per parameter element (weight, gradient, two moments).
    # ZeRO-3 over 4 ranks keeps a quarter of each, read from the tensors' storage
    # after training, plus the padding: each parameter starts at a multiple of 16
    # elements (FlatLayout's alignment, what _grouped_mm needs of a view) and each
    # unit is cut into 4 chunks of a multiple of 16 (at most 15 per tensor, 63 per unit). A rank's
    # chunks hold at most (n + padding) / 4 elements, the padding falling in some ranks' more than
    # in others': at least (n + padding) / 4 - padding of them are parameters.
    z3, z1 = job("dp4_b4_zero3"), job("dp4_b4_zero1")
    n = int(re.search(r"model gpt: (\d+) parameters", z3.output).group(1))
    units = 2 + 2  # before the blocks, 2 blocks, after the blocks
    tensors = 5 + 2 * 12  # wte, wpe, ln_f (2) and the head's bias at most; per block 12 (weights and biases)
    padding = 15 * tensors + 63 * units
    lo, hi = 16 * (n - 3 * padding) / 4, 16 * (n + padding) / 4
    for rank, held in held_total(z3).items():
        assert lo <= held <= hi, f"rank {rank} holds {held} bytes, want 1/4 of {16 * n} (+ padding): [{lo}, {hi}]"
    # The figure tells stages apart: ZeRO-1 keeps whole weights and gradients.
    for rank, held in held_total(z1).items():
        assert held >= (4 + 4) * n, (rank, held)


def test_recompute_holds_fewer_activations(job):
    # What the parity run with recompute compares means something only if its
    # blocks were recomputed: the activations its forward keeps for backward are
    # fewer than the same run's without recompute (measured at the allocator).
    on, off = job("dp2_b4_zero3_recompute"), job("dp2_b4_zero3")
    a_on, a_off = on.by_step("activation_mb"), off.by_step("activation_mb")
    assert all(a_on[s] < 0.8 * a_off[s] for s in a_on), (a_on, a_off)
