"""A rank that dies or freezes mid-training ends the job promptly and says who.

Two ranks of the tiny GPT (configs/tiny_dp.yaml, compute_config.collective_timeout_s
5, a run far longer than the test) are started as torchrun would start them, without
the launcher: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set here. Once rank 0 has logged a few steps:
- rank 1 SIGKILLed: rank 0 exits non-zero within the timeout plus a margin, naming
  the collective and rank 1 as not answering;
- rank 0 SIGKILLed: rank 1 exits non-zero saying rank 0 (the store) is gone
  (test_launch_errors.py, which also checks that no LibTorch store warning comes with it);
- rank 1 SIGSTOPped: rank 0 exits non-zero within the timeout plus a margin,
  naming rank 1;
- under `nnstrain launch`, a worker SIGKILLed: the launcher exits non-zero naming it.
And before training: a rank that reports different device memory than rank 0
(the test switch NNSTRAIN_TEST_DEVICE_MEMORY_GB) makes both ranks exit non-zero
naming it, before any step, well within the collective timeout.
"""
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
CONFIG = HERE / "configs" / "tiny_dp.yaml"
SOURCE = pathlib.Path(os.environ.get("NNSTRAIN_SOURCE_DIR", HERE.parents[1]))
TIMEOUT_S = 5
# Beyond the collective timeout: the failure diagnosis watches heartbeats for
# 2.5 s, probes the store for up to 3 s, and the machine may be busy.
MARGIN_S = 15
START_S = 90  # to start and log the first steps


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env():
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    prefixes = ("SLURM_", "PBS_", "PALS_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(prefixes)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def train_args(tokens, run_dir):
    return ["--config", str(CONFIG), "--vars.data", str(tokens), "--run_dir", str(run_dir),
            "--compute_config.collective_timeout_s", str(TIMEOUT_S), "--max_train_steps", "1000000",
            "--lr_scheduler.args.decay_steps", "1000000"]


def logged_steps(run_dir):
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip() and "loss" in json.loads(line))


def wait_for_steps(run_dir, procs, n=3, timeout=START_S):
    """Polls rank 0's metrics until n steps are logged; fails if a process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if logged_steps(run_dir) >= n:
            return
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"{p.args} ended with {p.returncode} before training got going:\n{read(p)}")
        time.sleep(0.1)
    pytest.fail(f"no {n} steps logged in {run_dir} within {timeout} s")


def read(p):
    p.log.flush()
    return pathlib.Path(p.log.name).read_text()


def exit_within(p, seconds):
    """(exit status, seconds it took) or fails naming what it printed."""
    t0 = time.monotonic()
    try:
        rc = p.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {seconds} s after the failure:\n{read(p)}")
    return rc, time.monotonic() - t0


def killed_in_ring(job, dead=1):
    """Rank `dead` killed itself entering a ring step (NNSTRAIN_TEST_KILL_IN_RING); every other rank
    exits non-zero within the collective timeout plus a margin, its last line the one-line diagnosis
    naming a collective (LibTorch's store warnings once rank 0, the store's host, is gone go to the
    rank's log file: test_launch_errors.py). Returns the others' outputs by rank."""
    rc, _ = exit_within(job.procs[dead], START_S)
    assert rc == -9, f"rank {dead} was to kill itself in a ring step, exited {rc}:\n{read(job.procs[dead])}"
    outs = {}
    for rank in (r for r in range(len(job.procs)) if r != dead):
        p = job.procs[rank]
        rc, took = exit_within(p, TIMEOUT_S + MARGIN_S)
        out = outs[rank] = read(p)
        print(f"\nrank {rank} exited {rc} {took:.1f} s after rank {dead} died: {out.strip().splitlines()[-1]}")
        assert rc != 0, out
        assert re.match(rf"nnstrain: rank {rank}: collective '[^']+' .* failed", out.strip().splitlines()[-1]), out
    return outs

class Ranks:
    """`world` ranks (two by default) started by hand, as torchrun would, with
    `extra_args` after the usual ones; everything killed on exit."""

    def __init__(self, binary, tokens, tmp_path, world=2, extra_env=None, extra_args=()):
        self.run_dir = tmp_path / "run"
        port = free_port()
        self.procs = []
        for rank in range(world):
            env = base_env()
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.update(extra_env or {})
            log = open(tmp_path / f"rank{rank}.log", "w+")
            p = subprocess.Popen([binary, *train_args(tokens, self.run_dir), *map(str, extra_args)], cwd=SOURCE, env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
            p.log = log
            self.procs.append(p)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)  # also ends a SIGSTOPped process
                p.wait()
            p.log.close()


def survivor_of(binary, tokens, tmp_path, victim, sig):
    """Two ranks; once they train, `sig` to rank `victim`: (exit status, seconds to exit, output,
    run dir) of the other rank."""
    with Ranks(binary, tokens, tmp_path) as job:
        wait_for_steps(job.run_dir, job.procs)
        job.procs[victim].send_signal(sig)
        survivor = job.procs[1 - victim]
        rc, took = exit_within(survivor, TIMEOUT_S + MARGIN_S)
        out = read(survivor)
    print(f"\nrank {1 - victim} exited {rc} {took:.1f} s after {sig.name} to rank {victim}:\n"
          + "\n".join(out.splitlines()[-4:]))
    return rc, took, out, job.run_dir


def test_killed_rank_is_named_by_the_survivor(nnstrain_bin, tiny_tokens, tmp_path):
    rc, _, out, _ = survivor_of(nnstrain_bin, tiny_tokens, tmp_path, 1, signal.SIGKILL)
    assert rc != 0, out
    assert re.search(r"rank 0: collective '[^']+' .* failed", out), out
    assert re.search(r"ranks not answering \(process gone or frozen\): 1\b", out), out


def test_frozen_rank_is_named_within_the_timeout(nnstrain_bin, tiny_tokens, tmp_path):
    rc, took, out, _ = survivor_of(nnstrain_bin, tiny_tokens, tmp_path, 1, signal.SIGSTOP)
    assert rc != 0, out
    assert re.search(r"rank 0: collective '[^']+' .* failed", out), out
    assert re.search(r"ranks not answering \(process gone or frozen\): 1\b", out), out
    # It waited for the timeout rather than failing at once (rank 1 was alive, just silent).
    assert took >= TIMEOUT_S - 1, f"rank 0 gave up after {took:.1f} s, before the {TIMEOUT_S} s timeout"


def test_rank_with_other_device_memory_is_named_before_training(nnstrain_bin, tiny_tokens, tmp_path):
    with Ranks(nnstrain_bin, tiny_tokens, tmp_path, extra_env={"NNSTRAIN_TEST_DEVICE_MEMORY_GB": "1:3"}) as job:
        for rank, p in enumerate(job.procs):
            rc, took = exit_within(p, START_S)
            out = read(p)
            print(f"\nrank {rank} exited {rc} after {took:.1f} s: {out.strip().splitlines()[-1]}")
            assert rc != 0, out
            assert re.search(r"rank 1 \(host [^)]+\) reports device memory 3\.0 GiB \(rank 0: [0-9.]+ GiB\)", out), out
            assert "cannot agree on one plan" in out, out
            assert "Traceback" not in out and "frame #" not in out, out
        assert logged_steps(job.run_dir) == 0  # nothing trained


def children(pid):
    """Direct children of pid (Linux /proc)."""
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def env_var(pid, name):
    """Variable `name` of process pid's environment (as it was at its exec), or None."""
    try:
        env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    for kv in env:
        if kv.startswith(prefix):
            return kv[len(prefix):].decode()
    return None


def rank_of(pid):
    rank = env_var(pid, "RANK")
    return None if rank is None else int(rank)


def test_launcher_names_the_killed_worker(nnstrain_bin, tiny_tokens, tmp_path):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "launch.log", "w+")
    p = subprocess.Popen([nnstrain_bin, "launch", "--nproc-per-node", "2", "--",
                          *train_args(tiny_tokens, run_dir)],
                         cwd=SOURCE, env=base_env(), stdout=log, stderr=subprocess.STDOUT)
    p.log = log
    try:
        wait_for_steps(run_dir, [p])
        workers = {rank_of(c): c for c in children(p.pid)}
        assert sorted(workers) == [0, 1], f"launcher's children by RANK: {workers}"
        os.kill(workers[1], signal.SIGKILL)
        rc, took = exit_within(p, TIMEOUT_S + MARGIN_S)
        out = read(p)
        print(f"\nlauncher exited {rc} {took:.1f} s after rank 1 was killed:\n" + "\n".join(out.splitlines()[-4:]))
        assert rc != 0, out
        assert "rank 1 was killed by signal 9" in out, out
        assert re.search(r"failed: rank 1 was killed by signal 9", out), out
    finally:
        # The launcher stops its workers (SIGTERM, SIGKILL after its grace period);
        # their pids are not ours to signal once it may have reaped them.
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()
        log.close()
