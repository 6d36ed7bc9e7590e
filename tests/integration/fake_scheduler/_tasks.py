"""Shared by the fake srun and mpiexec: start every task locally with its own
variables, wait for all, echo their output labelled with the task number (as
`srun --label` does), and exit with the highest exit status."""
import os
import subprocess
import sys


def run_tasks(command, task_envs):
    procs = []
    for env in task_envs:
        full = dict(os.environ)
        full.update(env)
        procs.append(subprocess.Popen(command, env=full, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    status = 0
    for task, proc in enumerate(procs):
        out, err = proc.communicate()
        for line in out.splitlines():
            print(f"{task}: {line}")
        for line in err.splitlines():
            print(f"{task}: {line}", file=sys.stderr)
        status = max(status, proc.returncode if proc.returncode >= 0 else 128 - proc.returncode)
    sys.stdout.flush()
    return status


def fail(tool, message):
    print(f"fake {tool}: {message}", file=sys.stderr)
    sys.exit(2)


def record(tool, args):
    """Appends the call to $FAKE_SCHEDULER_LOG, for the test to read."""
    log = os.environ.get("FAKE_SCHEDULER_LOG")
    if not log:
        fail(tool, "FAKE_SCHEDULER_LOG is not set")
    with open(log, "a") as f:
        f.write(" ".join([tool, *args]) + "\n")
