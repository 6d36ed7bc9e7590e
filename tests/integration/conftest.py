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
