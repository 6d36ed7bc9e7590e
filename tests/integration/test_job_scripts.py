"""The SLURM and PBS job scripts, run as a cluster user submits them, under
fake schedulers (tests/integration/fake_scheduler/): a fake srun / mpiexec
starts the tasks on this machine with the scheduler's per-task variables, and
NNSTRAIN points at a stand-in that runs `nnstrain env` instead of training. Each
task must see the rank, world size, local rank, node and rendezvous address a
real launch would give it.

Environment: NNSTRAIN_BIN (the nnstrain binary), NNSTRAIN_SOURCE_DIR.
"""
import json
import os
import pathlib
import shutil
import subprocess

import pytest

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = pathlib.Path(os.environ.get("NNSTRAIN_SOURCE_DIR", HERE.parents[1]))
FAKES = HERE / "fake_scheduler"
DEFAULT_CONFIG = "configs/shakespeare_char.yaml"

# Launch variables of the machine running the tests must not leak into the job.
LAUNCH_PREFIXES = ("SLURM_", "PBS_", "PALS_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CONFIG", "GPUS", "NNSTRAIN",
               "NNSTRAIN_ROOT", "NNSTRAIN_ARGS"}


@pytest.fixture
def nnstrain_bin():
    path = os.environ.get("NNSTRAIN_BIN")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"NNSTRAIN_BIN={path!r} is not an executable nnstrain binary (build the nnstrain target)")
    return path


@pytest.fixture
def fake_bin(tmp_path):
    """The fake schedulers, copied so they are executable whatever the checkout's modes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for f in FAKES.iterdir():
        if f.is_file() and not f.name.endswith(".pyc"):
            shutil.copy(f, bin_dir / f.name)
            (bin_dir / f.name).chmod(0o755)
    return bin_dir


def job_env(fake_bin, nnstrain_bin, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCH_PREFIXES) and k not in LAUNCH_VARS}
    env.update(PATH=f"{fake_bin}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
               NNSTRAIN=str(fake_bin / "nnstrain_env"), NNSTRAIN_BIN=nnstrain_bin,
               PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def run_job(script, env, args=(), cwd=None):
    proc = subprocess.run(["bash", str(SOURCE / script), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def tasks_seen(stdout):
    """{task: (args line, DistEnv)} from the fake launcher's labelled output."""
    lines = {}
    for line in stdout.splitlines():
        task, sep, text = line.partition(": ")
        assert sep and task.isdigit(), f"unexpected output line {line!r}"
        lines.setdefault(int(task), []).append(text)
    seen = {}
    for task, texts in lines.items():
        assert len(texts) == 2 and texts[0].startswith("ARGS "), f"task {task} printed {texts}"
        seen[task] = (texts[0][len("ARGS "):], json.loads(texts[1]))
    return seen


def check_tasks(seen, nodes, per_node, launcher, master_addr, master_port, args):
    world = nodes * per_node
    assert sorted(seen) == list(range(world))
    for task, (got_args, env) in seen.items():
        assert got_args == args, f"task {task}"
        assert env == {
            "launcher": launcher,
            "rank": task,
            "world_size": world,
            "local_rank": task % per_node,
            "local_world_size": per_node,
            "node_rank": task // per_node,
            "num_nodes": nodes,
            "master_addr": master_addr,
            "master_port": master_port,
        }, f"task {task}"


def slurm_job_vars(nodes, per_node, nodelist, job_id):
    """What sbatch gives the batch script itself: the job's variables, and the
    batch step's own SLURM_PROCID=0 that srun must replace in every task."""
    return dict(SLURM_JOB_ID=str(job_id), SLURM_JOBID=str(job_id), SLURM_JOB_NODELIST=nodelist,
                SLURM_NODELIST=nodelist, SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes),
                SLURM_NTASKS=str(nodes * per_node), SLURM_NTASKS_PER_NODE=str(per_node),
                SLURM_TASKS_PER_NODE=f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
                SLURM_CPUS_PER_TASK="2", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
                SLURM_SUBMIT_DIR=str(SOURCE))


@pytest.mark.parametrize("nodes,per_node,nodelist,first_host", [
    (1, 2, "localhost", "localhost"),
    (2, 2, "fakenode[01-02]", "fakenode01"),
    (3, 1, "gpu-a[7,9],gpu-b3", "gpu-a7"),
])
def test_sbatch_script(tmp_path, fake_bin, nnstrain_bin, nodes, per_node, nodelist, first_host):
    env = job_env(fake_bin, nnstrain_bin, **slurm_job_vars(nodes, per_node, nodelist, 1234567))
    proc = run_job("scripts/slurm/train.sbatch", env, ["--optimizer.args.lr", "3e-4"], cwd=tmp_path)
    check_tasks(tasks_seen(proc.stdout), nodes, per_node, "slurm", first_host, 20000 + 1234567 % 10000,
                f"--config {DEFAULT_CONFIG} --optimizer.args.lr 3e-4")


def test_sbatch_script_overrides(tmp_path, fake_bin, nnstrain_bin):
    """CONFIG, GPUS and MASTER_ADDR / MASTER_PORT exported before sbatch reach every task."""
    env = job_env(fake_bin, nnstrain_bin, **slurm_job_vars(2, 4, "n[1-2]", 99),
                  CONFIG="configs/other.yaml", GPUS="3", MASTER_ADDR="n1-ib", MASTER_PORT="31000")
    proc = run_job("scripts/slurm/train.sbatch", env, cwd=tmp_path)
    check_tasks(tasks_seen(proc.stdout), 2, 3, "slurm", "n1-ib", 31000, "--config configs/other.yaml")


@pytest.mark.parametrize("hosts,per_node", [
    (["localhost"], 2),
    # PBS repeats each host once per MPI slot (mpiprocs=2).
    (["x3001c0s1b0n0", "x3001c0s1b0n0", "x3001c0s7b1n0", "x3001c0s7b1n0"], 2),
    (["h1", "h2", "h3"], 1),
])
def test_pbs_script(tmp_path, fake_bin, nnstrain_bin, hosts, per_node):
    node_file = tmp_path / "nodefile"
    node_file.write_text("".join(h + "\n" for h in hosts))
    nodes = len(dict.fromkeys(hosts))
    env = job_env(fake_bin, nnstrain_bin, PBS_JOBID="4321.fake-pbs", PBS_NODEFILE=str(node_file),
                  PBS_O_WORKDIR=str(SOURCE), GPUS=str(per_node),
                  NNSTRAIN_ARGS="--max_train_steps 10 --seed 3")
    # The script marks a started job in its working folder (PBS_O_WORKDIR, the checkout here); a marker
    # left by an earlier run of this test would make this one a rerun by PBS.
    marker = SOURCE / ".nnstrain-started-4321.fake-pbs"
    marker.unlink(missing_ok=True)
    try:
        proc = run_job("scripts/pbs/train.pbs", env, cwd=tmp_path)
    finally:
        assert marker.exists()  # the script marked the job as started
        marker.unlink()
    check_tasks(tasks_seen(proc.stdout), nodes, per_node, "pbs", hosts[0], 20000 + 4321,
                f"--config {DEFAULT_CONFIG} --max_train_steps 10 --seed 3")


def test_nnstrain_env_outside_any_launcher(nnstrain_bin, tmp_path):
    env = job_env(tmp_path, nnstrain_bin)
    out = subprocess.run([nnstrain_bin, "env"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"launcher": "none", "rank": 0, "world_size": 1, "local_rank": 0,
                                      "local_world_size": 1, "node_rank": 0, "num_nodes": 1,
                                      "master_addr": "127.0.0.1", "master_port": 29500}


def test_nnstrain_env_names_the_bad_variable(nnstrain_bin, tmp_path):
    env = job_env(tmp_path, nnstrain_bin, SLURM_PROCID="0", SLURM_STEP_ID="0", SLURM_LOCALID="0",
                  SLURM_NTASKS="two")
    out = subprocess.run([nnstrain_bin, "env"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "SLURM_NTASKS='two'" in out.stderr


def test_launch_then_env(nnstrain_bin, tmp_path):
    """`nnstrain launch` starts the binary itself; every worker's `nnstrain env` agrees."""
    env = job_env(tmp_path, nnstrain_bin)
    out = subprocess.run([nnstrain_bin, "launch", "--nproc-per-node", "3", "--", "env"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = {}
    for line in out.stdout.splitlines():
        prefix, _, text = line.partition("] ")
        assert prefix.startswith("[rank "), line
        seen[int(prefix[len("[rank "):])] = json.loads(text)
    assert sorted(seen) == [0, 1, 2]
    ports = {e["master_port"] for e in seen.values()}
    assert len(ports) == 1
    for rank, e in seen.items():
        assert (e["launcher"], e["rank"], e["world_size"], e["local_rank"], e["master_addr"]) == \
            ("torchrun", rank, 3, rank, "127.0.0.1")


# --- automatic restart through the scheduler's requeue ------------------------

def failing_nnstrain(tmp_path, status):
    """Stands in for a training run that fails: records its arguments and NNSTRAIN_RESTART_COUNT, exits `status`."""
    stub = tmp_path / "failing_nnstrain"
    stub.write_text(f'#!/bin/sh\nprintf "%s RESTART=%s\\n" "$*" "$NNSTRAIN_RESTART_COUNT" >> "{tmp_path}/runs"\n'
                    f'exit {status}\n')
    stub.chmod(0o755)
    return stub


def requeue_job(script, env):
    proc = subprocess.run(["bash", str(SOURCE / script)], env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("script,scheduler", [("scripts/slurm/train.sbatch", "slurm"),
                                              ("scripts/pbs/train.pbs", "pbs")])
def test_failed_job_is_requeued_then_found_deterministic(tmp_path, fake_bin, nnstrain_bin, script, scheduler):
    """A failure requeues the job (fake scontrol requeue / qrerun record the call); the requeued job
    resumes (NNSTRAIN_RESTART_COUNT set, the command as it was: nnstrain takes the latest checkpoint, or the
    run's own source before the first save); a second failure with no checkpoint since the first is
    deterministic: no requeue."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("step-00000004\n")
    calls = tmp_path / "calls"
    if scheduler == "slurm":
        job = slurm_job_vars(1, 1, "localhost", 777)
        requeue = "scontrol requeue 777"
    else:
        node_file = tmp_path / "nodefile"
        node_file.write_text("localhost\n")
        job = dict(PBS_JOBID="777.fake-pbs", PBS_NODEFILE=str(node_file), PBS_O_WORKDIR=str(tmp_path), GPUS="1")
        requeue = "qrerun 777.fake-pbs"
    env = job_env(fake_bin, nnstrain_bin, **job, NNSTRAIN=str(failing_nnstrain(tmp_path, 3)),
                  NNSTRAIN_ROOT=str(tmp_path), MAX_RESTARTS="2", CKPT_DIR=str(ckpt),
                  FAKE_SCHEDULER_LOG=str(calls))

    rc, err = requeue_job(script, env)
    assert rc == 3, err
    assert calls.read_text().splitlines() == [requeue], err
    # The scheduler starts the job again: SLURM counts in SLURM_RESTART_COUNT, PBS in the script's file.
    if scheduler == "slurm":
        env["SLURM_RESTART_COUNT"] = "1"
    # A checkpoint since the first failure: requeued again.
    (ckpt / "latest").write_text("step-00000006\n")
    rc, err = requeue_job(script, env)
    assert rc == 3 and calls.read_text().splitlines() == [requeue] * 2, err
    assert "restart 1 of 2: resuming from the latest checkpoint" in err
    runs = (tmp_path / "runs").read_text().splitlines()
    assert runs[0].endswith("RESTART=") and runs[1].endswith("RESTART=1"), runs
    assert "--resume" not in runs[1], runs
    # No checkpoint since: deterministic, not requeued.
    if scheduler == "slurm":
        env["SLURM_RESTART_COUNT"] = "2"
    env["MAX_RESTARTS"] = "3"
    rc, err = requeue_job(script, env)
    assert rc == 3 and calls.read_text().splitlines() == [requeue] * 2, err
    assert "deterministic failure: status 3 with no checkpoint since the last restart" in err


@pytest.mark.parametrize("status,restarts,max_restarts", [(0, "0", "2"), (3, "2", "2")], ids=["success", "no_restart_left"])
def test_sbatch_requeues_only_a_failure_with_restarts_left(tmp_path, fake_bin, nnstrain_bin, status, restarts,
                                                          max_restarts):
    calls = tmp_path / "calls"
    env = job_env(fake_bin, nnstrain_bin, **slurm_job_vars(1, 1, "localhost", 778),
                  NNSTRAIN=str(failing_nnstrain(tmp_path, status)), NNSTRAIN_ROOT=str(tmp_path),
                  MAX_RESTARTS=max_restarts, SLURM_RESTART_COUNT=restarts, FAKE_SCHEDULER_LOG=str(calls))
    rc, err = requeue_job("scripts/slurm/train.sbatch", env)
    assert rc == status, err
    assert not calls.exists(), calls.read_text()


def test_a_pbs_rerun_of_its_own_resumes(tmp_path, fake_bin, nnstrain_bin):
    """PBS reruns a job itself (a node failure, an operator's qrerun) under the same job id: the rerun is a
    restart for nnstrain (NNSTRAIN_RESTART_COUNT), never a fresh start over the run's save_dir."""
    node_file = tmp_path / "nodefile"
    node_file.write_text("localhost\n")
    env = job_env(fake_bin, nnstrain_bin, PBS_JOBID="779.fake-pbs", PBS_NODEFILE=str(node_file),
                  PBS_O_WORKDIR=str(tmp_path), GPUS="1", NNSTRAIN=str(failing_nnstrain(tmp_path, 0)),
                  NNSTRAIN_ROOT=str(tmp_path))
    for _ in range(2):
        rc, err = requeue_job("scripts/pbs/train.pbs", env)
        assert rc == 0, err
    assert "job 779.fake-pbs rerun by PBS: resuming from the latest checkpoint" in err
    runs = (tmp_path / "runs").read_text().splitlines()
    assert [r.rsplit(" ", 1)[1] for r in runs] == ["RESTART=", "RESTART=1"], runs
