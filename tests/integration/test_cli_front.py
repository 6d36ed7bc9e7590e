"""The front door: `nnstrain --version` and `nnstrain --help`.

- `--version` prints the version, the git commit of the source tree and whether
  its tracked files had changed (cmake/build_info.cmake, run at every build), the
  LibTorch version, whether the CUDA/NCCL code is compiled in with the CUDA and
  NCCL versions, and LibTorch's CPU capability; each is checked against a source
  other than the binary (git, the venv's torch, the compile command, nvcc, nccl.h).
- build_info.cmake itself follows commits and edits, rewrites its header only on
  a change, and says "unknown" outside a git checkout of its own.
- `--help` lists every subcommand the dispatcher (trainer/cli/cli.cpp) and
  `prepare`'s (data/prepare.cpp) accept, read from their source, so a new one that
  is not listed fails here; README.md's command list too; and each answers --help.
- The config checks that live above base/ (handed to the loader in
  LoadOptions::checks) stop `nnstrain train` and `nnstrain plan` at load: exit 2,
  one line naming the key and its line, nothing started.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

from conftest import SOURCE, nnstrain_bin_path, single_process_env

BUILD = pathlib.Path(os.environ.get("NNSTRAIN_BUILD_DIR", ""))
# What the nnstrain binary is compiled from (a tracked change here makes its tree dirty).
BUILD_INPUTS = ("base/", "data/", "models/", "trainer/", "third_party/", "cmake/", "CMakeLists.txt")


def run(*args, check=True, **kw):
    p = subprocess.run([*args], capture_output=True, text=True, timeout=120, **kw)
    if check:
        assert p.returncode == 0, (args, p.returncode, p.stdout, p.stderr)
    return p


def version_fields():
    p = run(nnstrain_bin_path(), "--version")
    lines = p.stdout.splitlines()
    head = re.fullmatch(r"nnstrain (\S+)", lines[0])
    assert head, p.stdout
    fields = dict(line.split(": ", 1) for line in lines[1:])
    assert sorted(fields) == ["commit", "cpu capability", "cuda", "libtorch", "tree"], p.stdout
    return head.group(1), fields


def cmake_cache(key):
    cache = BUILD / "CMakeCache.txt"
    if not cache.exists():
        pytest.fail(f"NNSTRAIN_BUILD_DIR={str(BUILD)!r}: no CMakeCache.txt (set it to the build folder)")
    m = re.search(rf"^{re.escape(key)}:[A-Z]+=(.*)$", cache.read_text(), re.M)
    return m.group(1) if m else None


def git(*args, cwd=SOURCE):
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=60)


def test_version_names_this_build():
    version, f = version_fields()
    declared = re.search(r"project\(nnstrain VERSION (\S+)", (SOURCE / "CMakeLists.txt").read_text())
    assert declared and version == declared.group(1), (version, declared)

    top = git("rev-parse", "--show-toplevel")
    if top.returncode == 0 and pathlib.Path(top.stdout.strip()).resolve() == SOURCE.resolve():
        head = git("rev-parse", "HEAD").stdout.strip()
        assert f["commit"] == head, f"binary built at {f['commit']}, source tree at {head}: rebuild"
        # Edits since the build to files the binary is not built from (a test, a doc) need
        # no rebuild, so only these two states say what the binary must print.
        changed = git("status", "--porcelain", "--untracked-files=no").stdout.splitlines()
        built_from = [c for c in changed if c[3:].startswith(BUILD_INPUTS)]
        if built_from:
            assert f["tree"] == "dirty", f"built from edited sources {built_from} but says {f['tree']} (rebuild?)"
        elif not changed:
            assert f["tree"] == "clean", f"the tree is at {head} unedited, but the binary says {f['tree']} (rebuild?)"
        else:
            assert f["tree"] in ("clean", "dirty"), f
    else:  # a source tree without its own .git (a tarball)
        assert (f["commit"], f["tree"]) == ("unknown", "unknown"), f

    # The LibTorch it was built against is the venv's torch (setup.sh points CMake at it).
    assert f["libtorch"] == torch.__version__.split("+")[0], (f["libtorch"], torch.__version__)
    # The same library on the same machine picks the same CPU kernels.
    assert f["cpu capability"] == torch.backends.cpu.get_cpu_capability(), f

    # Compiled in exactly when version.cpp's compile command defines NNSTRAIN_CUDA.
    commands = json.loads((BUILD / "compile_commands.json").read_text())
    entry = [c for c in commands if c["file"].endswith("trainer/cli/version.cpp")]
    assert len(entry) == 1, [c["file"] for c in commands if "cli" in c["file"]]
    if "-DNNSTRAIN_CUDA" not in entry[0]["command"].split():
        assert f["cuda"] == "not compiled in (CPU-only build)", f
        return
    m = re.fullmatch(r"compiled in \(CUDA (\d+\.\d+), NCCL (\d+\.\d+\.\d+)\)", f["cuda"])
    assert m, f["cuda"]
    nvcc = run(cmake_cache("CUDAToolkit_NVCC_EXECUTABLE"), "--version").stdout
    assert f"release {m.group(1)}," in nvcc, (m.group(1), nvcc)
    header = (pathlib.Path(cmake_cache("NNSTRAIN_NCCL_INCLUDE_DIR")) / "nccl.h").read_text()
    nccl = ".".join(re.search(rf"#define NCCL_{k} (\d+)", header).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    assert m.group(2) == nccl, (m.group(2), nccl)


def cmake_exe():
    ctest = os.environ.get("NNSTRAIN_CTEST")
    beside = pathlib.Path(ctest).with_name("cmake") if ctest else None
    exe = str(beside) if beside and beside.exists() else shutil.which("cmake")
    if not exe:
        pytest.fail("no cmake to run cmake/build_info.cmake with (set NNSTRAIN_CTEST or put cmake on PATH)")
    return exe


def test_build_info_follows_the_tree(tmp_path):
    cmake = cmake_exe()
    out = tmp_path / "build_info.h"

    def info(src):
        run(cmake, f"-DSOURCE_DIR={src}", f"-DOUT={out}", "-DVERSION=9.8.7", f"-DGIT={shutil.which('git')}",
            "-P", str(SOURCE / "cmake" / "build_info.cmake"))
        text = out.read_text()
        fields = dict(re.findall(r'#define NNSTRAIN_(\w+) "([^"]*)"', text))
        return fields["VERSION"], fields["GIT_COMMIT"], fields["GIT_TREE"]

    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    g = lambda *a: run("git", "-C", str(repo), *a, env={**os.environ, **env})  # noqa: E731
    g("init", "-q")
    (repo / "a.txt").write_text("one\n")
    g("add", "a.txt")
    g("commit", "-q", "-m", "one")
    first = g("rev-parse", "HEAD").stdout.strip()
    assert info(repo) == ("9.8.7", first, "clean")
    stamp = out.stat().st_mtime_ns
    assert info(repo) == ("9.8.7", first, "clean") and out.stat().st_mtime_ns == stamp, "rewritten with no change"
    (repo / "notes.txt").write_text("untracked\n")
    assert info(repo)[2] == "clean"  # as git describe --dirty: untracked files do not count
    (repo / "a.txt").write_text("two\n")
    assert info(repo) == ("9.8.7", first, "dirty")
    g("commit", "-q", "-am", "two")
    second = g("rev-parse", "HEAD").stdout.strip()
    assert second != first and info(repo) == ("9.8.7", second, "clean")
    # Not a checkout of its own: a tarball alone, or unpacked inside another repository.
    tarball = tmp_path / "tarball"
    tarball.mkdir()
    assert info(tarball) == ("9.8.7", "unknown", "unknown")
    assert info(repo / "sub") == ("9.8.7", "unknown", "unknown")


def subcommands():
    """What the dispatchers accept, read from their source: nnstrain's commands and
    the kinds `nnstrain prepare` takes."""
    cli = (SOURCE / "trainer" / "cli" / "cli.cpp").read_text()
    commands = re.findall(r'if \(cmd == "([a-z][a-z_-]*)"\)', cli)
    flags = re.findall(r'if \(cmd == "(--[a-z-]+)"\)', cli)
    prepare = (SOURCE / "data" / "prepare.cpp").read_text()
    # The lines that dispatch: `if (... args[0] == "corpus") return ...`, `if (o.dataset == "text") return ...`.
    kinds = re.findall(r'args\[0\] == "(\w+)"\) return', prepare) + re.findall(r'o\.dataset == "(\w+)"\) return', prepare)
    assert "train" in commands and "prepare" in commands and "--version" in flags, (commands, flags)
    assert {"shakespeare_char", "text", "corpus"} <= set(kinds), kinds
    return commands, flags, kinds


def listed(text, commands, flags, kinds):
    """The commands, flags and prepare kinds `text` has no `nnstrain ...` line for."""
    lines = [line.strip() for line in text.splitlines()]
    def has(prefix):
        return any(line == prefix or line.startswith(prefix + " ") for line in lines)
    missing = [c for c in commands if not has(f"nnstrain {c}") and not (c == "train" and has("nnstrain [train]"))]
    missing += [f for f in flags if not has(f"nnstrain {f}")]
    missing += [f"prepare {k}" for k in kinds if not has(f"nnstrain prepare {k}")]
    return missing


def test_help_lists_every_subcommand():
    commands, flags, kinds = subcommands()
    for args in (["--help"], ["-h"], ["help"]):
        out = run(nnstrain_bin_path(), *args).stdout
        assert not listed(out, commands, flags, kinds), (args, listed(out, commands, flags, kinds), out)
    # README.md's command list (its ```...``` block under "## Commands").
    readme = (SOURCE / "README.md").read_text()
    block = re.search(r"^## Commands\n+```\n(.*?)```", readme, re.M | re.S)
    assert block, "README.md: no ``` block under ## Commands"
    assert not listed(block.group(1), commands, flags, kinds), listed(block.group(1), commands, flags, kinds)


def test_every_subcommand_answers_help():
    commands, _, kinds = subcommands()
    for c in commands + [f"prepare {k}" for k in kinds if k == "corpus"]:
        p = run(nnstrain_bin_path(), *c.split(), "--help", check=False)
        out = p.stdout + p.stderr
        name = "nnstrain [train]" if c == "train" else f"nnstrain {c}"
        assert p.returncode == 0 and name in out, (c, p.returncode, out)


def test_the_check_sees_a_missing_line():
    # The matcher itself: a usage text without `prepare corpus` or `--version` is caught.
    commands, flags, kinds = subcommands()
    full = "\n".join([f"  nnstrain {c} ..." for c in commands] + [f"  nnstrain {f}" for f in flags] +
                     [f"  nnstrain prepare {k} ..." for k in kinds])
    assert listed(full, commands, flags, kinds) == []
    short = "\n".join(line for line in full.splitlines() if "corpus" not in line and "--version" not in line)
    assert listed(short, commands, flags, kinds) == ["--version", "prepare corpus"]


# A pipeline 1f1b_interleaved cannot run (3 micro-batches on 2 ranks), and an indexed
# dataset with no manifest; the line numbers are the ones the errors must name.
PIPELINE = """\
model: {type: gpt, args: {vocab_size: 64, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}}
dataset: {train_args: {path: TOKENS, seq_len: 16}}
micro_batch_size: 2
max_train_steps: 1
run_dir: RUN
pas_policy: hybrid
grad_accumulation_steps: 3
compute_config:
  device: cpu
  runtime_ngpus: 2
  pas_config:
    pp_size: 2
    pipeline_scheduler: 1f1b_interleaved
"""
INDEXED = """\
model: {type: gpt, args: {vocab_size: 64, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}}
micro_batch_size: 2
max_train_steps: 1
run_dir: RUN
compute_config: {device: cpu}
dataset:
  type: indexed
  train_args:
    datasets:
      - path: MISSING
    seq_len: 16
"""


@pytest.mark.parametrize("config,commands,expected", [
    (PIPELINE, ("train", "plan"), ("compute_config.pas_config.pipeline_scheduler (line 13): ",
                                   "needs pipeline_nmicros a multiple of pp_size")),
    (INDEXED, ("train",), ("dataset.train_args.datasets[0].path (line 10): ", "no dataset manifest")),
], ids=["pipeline_schedule", "indexed_datasets"])
def test_module_checks_stop_the_command_at_load(tmp_path, tiny_tokens, config, commands, expected):
    run_dir = tmp_path / "run"
    text = config.replace("TOKENS", str(tiny_tokens)).replace("RUN", str(run_dir))
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("MISSING", str(tmp_path / "missing")))
    for command in commands:
        p = subprocess.run([nnstrain_bin_path(), command, "--config", str(path)], capture_output=True, text=True,
                           timeout=120, env=single_process_env())
        lines = p.stderr.splitlines()
        assert p.returncode == 2 and len(lines) == 1, (command, p.returncode, p.stdout, p.stderr)
        prefix = "nnstrain: config error: " if command == "train" else "nnstrain plan: config error: "
        assert lines[0].startswith(prefix + str(path) + ": "), lines[0]
        assert all(e in lines[0] for e in expected), (expected, lines[0])
        assert not run_dir.exists(), f"{command}: the run started ({run_dir} exists) before the config was refused"
