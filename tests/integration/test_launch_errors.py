"""Launch errors a user sees: one line of ours, no LibTorch noise before it.

- A rendezvous port in use, named by the user: `nnstrain launch --master-port P`
  stops before starting any worker, and a rank 0 started by hand with MASTER_PORT=P
  exits 2; each in one line naming the port and the flag or variable, no backtrace.
- The port the launcher picked cannot be taken by another process (a second
  launch) once the workers know it: this test tries as soon as a worker's
  MASTER_PORT is readable, and the run trains on. (With the old find, close and
  let rank 0 re-bind scheme the test got the port every time, and rank 0 died
  with EADDRINUSE and a backtrace.)
- Rank 0 (the rendezvous store's host) killed mid-training: the survivor's output
  holds our one-line diagnosis and none of LibTorch's store warnings (c10 log
  records "[W1124 12:00:00.123 ... TCPStore.cpp:106] ..." with backtraces), which
  go to its log file (run_dir/logs/rank1.log) instead.
Tiny GPT of configs/tiny_dp.yaml, two ranks on Gloo; seconds each.
"""
import errno
import re
import signal
import socket
import subprocess
import time

import pytest

from test_collective_failure import CONFIG, SOURCE, base_env, children, env_var, free_port, survivor_of

# A c10 log record's header (a worker's, under the launcher, after "[rank N] "), or a C++ backtrace.
TORCH_NOISE = re.compile(r"^(\[rank \d+\] )?\[[IWEF]\d{4} |frame #\d|Exception raised from|c10::", re.M)


def held_port():
    """A socket listening on a free port, as another job's would be."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def short_run(tokens, run_dir, steps=2):
    return ["--config", str(CONFIG), "--vars.data", str(tokens), "--run_dir", str(run_dir),
            "--max_train_steps", str(steps)]


def test_master_port_in_use_stops_the_launcher_in_one_line(nnstrain_bin, tiny_tokens, tmp_path):
    s, port = held_port()
    with s:
        p = subprocess.run([nnstrain_bin, "launch", "--nproc-per-node", "2", "--master-port", str(port), "--",
                            *short_run(tiny_tokens, tmp_path / "run")],
                           cwd=SOURCE, env=base_env(), capture_output=True, text=True, timeout=60)
    print(p.stderr)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr == (f"nnstrain launch: --master-port {port} is already in use on this machine (another job, "
                        "or one that has not ended, listens on it): choose another port, or leave --master-port "
                        "out on one node\n")
    assert p.stdout == ""  # no worker started
    assert not (tmp_path / "run").exists()


def test_master_port_in_use_stops_rank0_in_one_line(nnstrain_bin, tiny_tokens, tmp_path):
    """Rank 0 started as torchrun or srun starts it, its MASTER_PORT taken."""
    s, port = held_port()
    env = base_env()
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    with s:
        p = subprocess.run([nnstrain_bin, *short_run(tiny_tokens, tmp_path / "run")], cwd=SOURCE, env=env,
                           capture_output=True, text=True, timeout=120)
    print(p.stderr)
    assert p.returncode == 2, p.stdout + p.stderr
    assert not TORCH_NOISE.search(p.stderr), p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("nnstrain:")]
    assert errors == [f"nnstrain: launch environment error: rank 0: the rendezvous port {port} "
                      f"(MASTER_PORT={port}) is already in use on this machine (another job, or one that has not "
                      "ended, listens on it): set MASTER_PORT to a free port"], p.stderr


def test_rank_whose_rank0_never_comes_fails_in_one_line(nnstrain_bin, tiny_tokens, tmp_path):
    """Rank 1 of 2 started alone: its rendezvous times out (twice collective_timeout_s: LibTorch
    retries once), in our one line; LibTorch's retry warnings go to its log file."""
    port = free_port()
    env = base_env()
    env.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    args = [*short_run(tiny_tokens, tmp_path / "run"), "--compute_config.collective_timeout_s", "1"]
    p = subprocess.run([nnstrain_bin, *args], cwd=SOURCE, env=env, capture_output=True, text=True, timeout=120)
    print(p.stderr)
    assert p.returncode == 1, p.stdout + p.stderr
    assert not TORCH_NOISE.search(p.stderr), p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"nnstrain: rank 1: rendezvous with 127.0.0.1:{port} failed: "), p.stderr
    log = (tmp_path / "run" / "logs" / "rank1.log").read_text()
    assert re.search(r"\[debug\] LibTorch, in a store call whose failure nnstrain reports: \[[WE]\d{4} .*\[c10d\]",
                     log), log


def test_port_the_launcher_picked_cannot_be_taken_before_rank0_serves_it(nnstrain_bin, tiny_tokens, tmp_path):
    """Another process (a second launch) binding the port as soon as the workers know it: it finds
    the port taken, and the run goes on. (When the launcher closed the port it had found and rank 0
    bound it again once LibTorch had loaded, such a process got the port and rank 0 died.)"""
    log = open(tmp_path / "launch.log", "w+")
    p = subprocess.Popen([nnstrain_bin, "launch", "--nproc-per-node", "2", "--",
                          *short_run(tiny_tokens, tmp_path / "run")],
                         cwd=SOURCE, env=base_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        port, deadline = None, time.monotonic() + 30
        while port is None and p.poll() is None and time.monotonic() < deadline:
            port = next((v for v in (env_var(c, "MASTER_PORT") for c in children(p.pid)) if v), None)
        assert port is not None, "no worker with MASTER_PORT seen"
        with socket.socket() as s:
            with pytest.raises(OSError) as taken:
                s.bind(("127.0.0.1", int(port)))
                s.listen()
            assert taken.value.errno == errno.EADDRINUSE, taken.value
        rc = p.wait(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = (tmp_path / "launch.log").read_text()
    assert rc == 0, out
    assert re.search(r"step 2/2: loss", out), out


def test_survivor_of_rank0_prints_our_line_not_torch_store_warnings(nnstrain_bin, tiny_tokens, tmp_path):
    rc, _, out, run_dir = survivor_of(nnstrain_bin, tiny_tokens, tmp_path, 0, signal.SIGKILL)
    last = out.strip().splitlines()[-1]
    assert rc != 0, out
    assert re.match(r"nnstrain: rank 1: collective '[^']+' .* failed", last), out
    assert "the rendezvous store on rank 0 is unreachable: rank 0 is gone" in last, out
    assert not TORCH_NOISE.search(out), out
    # Not lost: LibTorch's records of the failed store calls are in rank 1's log file.
    log = (run_dir / "logs" / "rank1.log").read_text()
    assert re.search(r"\[debug\] LibTorch, in a store call whose failure nnstrain reports: \[[WE]\d{4} .*\[c10d\]",
                     log), log
