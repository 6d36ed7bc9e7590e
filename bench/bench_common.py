"""What every benchmark records and how it runs nnstrain: the machine, the
LibTorch the binary loads, the commit, and a single-process run."""
import json
import os
import pathlib
import platform
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cpu_model():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def libtorch_version(binary):
    """Version of the libtorch the binary loads (ldd -> torch/lib -> torch/version.py)."""
    try:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        m = re.search(r"libtorch_cpu\.so => (\S+)", out)
        if m:
            version_py = pathlib.Path(m.group(1)).resolve().parent.parent / "version.py"
            v = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", version_py.read_text())
            if v:
                return v.group(1)
    except OSError:
        pass
    return "unknown"


def git_commit():
    """HEAD, with -dirty when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def binary_commit(binary):
    """The commit the binary says it was built from, with `dirty` when its tree had changes (`nnstrain --version`):
    what ran, where git_commit() is the checkout's."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    commit = re.search(r"^commit: (\S+)", out, re.M)
    tree = re.search(r"^tree: (\S+)", out, re.M)
    return (commit.group(1) if commit else "unknown") + ("-dirty" if tree and tree.group(1) == "dirty" else "")


def run_single(args, threads):
    """One single-process nnstrain run on `threads` threads, without a launcher's
    variables; exits the benchmark with the run's output if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([str(a) for a in args], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"nnstrain failed ({p.returncode}): {' '.join(map(str, args))}\n{p.stdout}{p.stderr}")
    return p


STARTUP_TENSORS = re.compile(r"rank 0: start-up peak host RSS [0-9.]+ MiB, tensors in use ([0-9.]+) MiB")


def run_ranks(binary, nproc, args, timeout=1200):
    """nnstrain `args` on `nproc` processes (through `nnstrain launch` when > 1), one thread
    each; exits the benchmark with the run's output if it fails."""
    cmd = [str(binary), *map(str, args)]
    if nproc > 1:
        cmd = [str(binary), "launch", "--nproc-per-node", str(nproc), "--", *map(str, args)]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return p


def startup_tensors_mib(run_dir):
    """Rank 0's tensor bytes in use once model and training state are built (its log), MiB."""
    for log in (pathlib.Path(run_dir) / "logs").glob("*"):
        m = STARTUP_TENSORS.search(log.read_text())
        if m:
            return float(m.group(1))
    return None


def step_record(run_dir, step):
    """The training record of `step` in a run's metrics.jsonl (one with peak_tensor_mb)."""
    recs = [json.loads(l) for l in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return next(r for r in recs if r.get("step") == step and "peak_tensor_mb" in r)


def result_record(binary, stamp, **fields):
    """What every result file records (date, device, LibTorch, commit, load averages), plus `fields`."""
    return {"date": stamp.isoformat(timespec="seconds"), "device": cpu_model(), "libtorch": libtorch_version(binary),
            "commit": git_commit(), "load": os.getloadavg(), **fields}


def machine_line(rec):
    """The result's machine and build, as a Markdown list item."""
    return (f"- device: {rec['device']}; LibTorch {rec['libtorch']}; commit {rec['commit']}; load averages "
            f"{', '.join(f'{x:.1f}' for x in rec['load'])}")


def write_result(out_dir, prefix, stamp, rec, md_lines):
    """Writes <out_dir>/<prefix>_<UTC time>.json (rec) and .md (md_lines), and prints the Markdown."""
    name = f"{prefix}_{stamp.strftime('%Y%m%d-%H%M%S')}"
    pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
    pathlib.Path(out_dir, name + ".json").write_text(json.dumps(rec, indent=1))
    pathlib.Path(out_dir, name + ".md").write_text("\n".join(md_lines) + "\n")
    print("\n".join(md_lines))


def parse_args(doc, more=None):
    """--nnstrain (the binary, default build/nnstrain) and --out (default bench/results), described by `doc`'s first
    line; `more(parser)` adds a benchmark's own options."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--nnstrain", default=str(ROOT / "build" / "nnstrain"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    if more:
        more(ap)
    return ap.parse_args()


def random_tokens(path, vocab, n, seed=0):
    """A token file of n uniform random ids below vocab (uint16), for benches that need any data."""
    import numpy as np
    np.random.default_rng(seed).integers(0, vocab, n, dtype=np.uint16).tofile(path)
    return path
