"""Hostile inputs through the nnstrain binary, as a user who got them from someone
else would meet them. Every case must end with a clear one-line error and the
expected exit status, quickly, in bounded memory, and open nothing outside its
folder:

- a checkpoint whose manifest names shard files by absolute path, with `..`,
  with a nested path, or whose shard is a symbolic link leaving the folder: each
  refused by `nnstrain merge` and by `--resume`, although a decoy that would parse
  lies at the place named (so a success would mean it was opened);
- YAML alias bombs (in `vars:` and in a key nnstrain reads), 10 MB explicit and
  plain keys, deep nesting: exit 2, a short message;
- a token file with an id at the vocabulary: exit 2 before training.

Run as a script, it prints the table of cases (case, exit, seconds, peak RSS,
message) recorded in bench/results/hostile_inputs.md:
    NNSTRAIN_BIN=build/nnstrain python tests/integration/test_hostile_inputs.py
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from conftest import CONFIGS, SOURCE, nnstrain_bin_path, single_process_env, write_token_file  # noqa: E402

CONFIG = CONFIGS / "tiny_gpt.yaml"
BOUND_S = 5.0          # every case ends well within this (the unbounded loader ran for minutes)
BOUND_RSS_MB = 1500    # the binary with LibTorch loaded is ~400 MB; the 10 MB key took 3.5 GB


def run_measured(args, cwd=SOURCE):
    """(exit status, seconds, peak RSS in MB, stderr) of one nnstrain process; the RSS
    is the process's own (os.wait4), not the cumulative figure of getrusage."""
    t0 = time.monotonic()
    p = subprocess.Popen([nnstrain_bin_path(), *map(str, args)], cwd=cwd, env=single_process_env(1),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = t0 + 120
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            p.kill()
            pid, status, usage = os.wait4(p.pid, 0)
            p.returncode = -9
            return None, time.monotonic() - t0, usage.ru_maxrss / 1024, "TIMEOUT"
        time.sleep(0.01)
    secs = time.monotonic() - t0
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    p.returncode = code
    return code, secs, usage.ru_maxrss / 1024, err


# ------------------------------------------------------------------ the cases


def saved_checkpoint(root):
    """A tiny GPT trained 2 steps with a checkpoint: (its step folder, the token file)."""
    tokens = write_token_file(root / "tokens.bin")
    code, _, _, err = run_measured(["--config", CONFIG, "--run_dir", root / "run", "--vars.data", tokens,
                           "--checkpoint.save_dir", root / "run/ckpt", "--max_train_steps", 2,
                           "--val_every_n_train_steps", 0])
    assert code == 0, err
    return root / "run/ckpt/step-00000002", tokens


def hostile_checkpoint(src, root, kind):
    """A copy of checkpoint `src` whose rank-0 shard is reached in a hostile way, and a
    valid decoy at the place named (so loading would succeed if it were opened)."""
    ck = root / f"ck_{kind}"
    shutil.copytree(src, ck)
    shard = "rank-00000.safetensors"
    manifest = json.loads((ck / "manifest.json").read_text())
    decoy = root / f"decoy_{kind}.safetensors"
    shutil.copy(ck / shard, decoy)
    name = None
    if kind == "absolute":
        name = str(decoy)
    elif kind == "dotdot":
        name = f"../decoy_{kind}.safetensors"
    elif kind == "nested":
        (ck / "sub").mkdir()
        shutil.copy(ck / shard, ck / "sub" / shard)
        name = f"sub/{shard}"
    elif kind == "symlink":
        (ck / shard).unlink()
        (ck / shard).symlink_to(decoy)
    if name is not None:
        manifest["files"][name] = manifest["files"].pop(shard)
        (ck / "manifest.json").write_text(json.dumps(manifest))
        (ck / shard).unlink()
    return ck


def alias_bomb(levels=9):
    lines = ["  a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def yaml_case(root, kind):
    """A config file holding one YAML hazard (10^9 nodes, 10 MB keys, deep nesting)."""
    base = CONFIG.read_text()
    if kind == "bomb_in_vars":
        text = base.replace("vars:\n", "vars:\n" + alias_bomb(), 1)
    elif kind == "bomb_in_read_key":
        text = base + "dataloader:\n" + alias_bomb()
    elif kind == "explicit_key_10mb":
        text = base + "? " + "k" * 10_000_000 + "\n: 1\n"
    elif kind == "plain_key_10mb":
        text = base + "k" * 10_000_000 + ": 1\n"
    elif kind == "plain_key_300kb":
        text = base + "k" * 300_000 + ": 1\n"
    elif kind == "nesting_5000":
        text = base + "extra: " + "[" * 5000 + "]" * 5000 + "\n"
    path = root / f"{kind}.yaml"
    path.write_text(text)
    return path


def cases(root):
    """[(case, args, expected exit, substrings of the message)] over one scratch folder."""
    ck, tokens = saved_checkpoint(root)
    out = []
    for kind, fault in [("absolute", "contains '/'"), ("dotdot", "contains '/'"), ("nested", "contains '/'"),
                        ("symlink", "is a symbolic link to")]:
        bad = hostile_checkpoint(ck, root, kind)
        out.append((f"manifest {kind}: merge", ["merge", bad, "--out", root / f"merged_{kind}"], 1, [fault]))
        out.append((f"manifest {kind}: --resume", ["--config", CONFIG, "--run_dir", root / f"resume_{kind}",
                                                   "--vars.data", tokens, "--resume", bad], 1, [fault]))
    for kind, words in [("bomb_in_vars", ["YAML nodes with aliases expanded", ": vars.a"]),
                        ("bomb_in_read_key", ["YAML nodes with aliases expanded", ": dataloader.a"]),
                        ("explicit_key_10mb", ["over the limit of 1048576 bytes"]),
                        ("plain_key_10mb", ["over the limit of 1048576 bytes"]),
                        ("plain_key_300kb", ["YAML syntax error", "'kkkk", "a plain key may have at most 1024"]),
                        ("nesting_5000", ["YAML syntax error", "nested deeper than 64 levels"])]:
        out.append((f"yaml {kind}", ["--config", yaml_case(root, kind), "--vars.data", tokens], 2, words))
    over = root / "over_vocab.bin"
    toks = np.fromfile(tokens, dtype="<u2").copy()
    toks[len(toks) // 2] = 64  # tiny_gpt's vocab_size is 64: ids 0..63
    toks.astype("<u2").tofile(over)
    out.append(("token id = vocab_size", ["--config", CONFIG, "--run_dir", root / "run_vocab", "--vars.data", over],
                2, ["holds token id 64", "vocabulary has 64 ids", str(over)]))
    return out


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return root, {c[0]: c for c in cases(root)}


NAMES = ([f"manifest {k}: {w}" for k in ("absolute", "dotdot", "nested", "symlink") for w in ("merge", "--resume")] +
         [f"yaml {k}" for k in ("bomb_in_vars", "bomb_in_read_key", "explicit_key_10mb", "plain_key_10mb",
                                "plain_key_300kb", "nesting_5000")] + ["token id = vocab_size"])


@pytest.mark.parametrize("name", NAMES)
def test_hostile_input_is_a_clear_error(hostile, name):
    root, table = hostile
    _, args, want_code, words = table[name]
    code, secs, rss, err = run_measured(args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == want_code, f"exit {code}, want {want_code}:\n{err[-3000:]}"
    assert lines and all(w in lines[-1] for w in words), f"the error does not say {words}:\n{err[-3000:]}"
    assert len(lines[-1]) < 600, f"a {len(lines[-1])}-character message"
    assert "Exception raised from" not in err and "frame #" not in err, "a LibTorch backtrace for a user's mistake"
    assert secs < BOUND_S, f"{secs:.1f} s"
    assert rss < BOUND_RSS_MB, f"peak RSS {rss:.0f} MB"
    if name == "token id = vocab_size":
        assert not (root / "run_vocab" / "metrics.jsonl").exists() or \
            not (root / "run_vocab" / "metrics.jsonl").read_text().strip(), "training started"
    if name.endswith(": merge"):
        kind = name.split()[1].rstrip(":")
        assert not (root / f"merged_{kind}").exists() and not (root / f"merged_{kind}.tmp").exists()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        print("| case | exit | seconds | peak RSS MB | message |\n|---|---|---|---|---|")
        for name, args, want, _ in cases(root):
            code, secs, rss, err = run_measured(args)
            msg = ([line for line in err.splitlines() if line.strip()] or [""])[-1].replace(str(root), "TMP")
            msg = msg.replace("|", "\\|")
            print(f"| {name} | {code} | {secs:.2f} | {rss:.0f} | {msg[:300]} |")
