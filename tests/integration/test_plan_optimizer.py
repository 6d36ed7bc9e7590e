"""`nnstrain plan` shows the optimizer's share of the step (issue 41): a line
`optimizer  T s (TYPE, P% of the step): ...` under the step time, for AdamW
(its element-wise update) and Muon (Newton-Schulz on the busiest owner, the
gather and scatter of its matrices, the element-wise part); `--json` carries
the same figures. Muon's FLOPs are checked against ns_steps x (4 m^2 n + 2 m^3)
per block matrix worked out here from the config's GPT shapes. Plans only:
nothing is trained, no data is read.
"""
import json
import re
import subprocess

import pytest

from conftest import CONFIGS, SOURCE, nnstrain_bin_path, single_process_env

LAYERS, EMBD = 2, 32  # tiny_gpt_muon.yaml's model (tiny_gpt.yaml's for AdamW)
OPTIMIZER_LINE = re.compile(r"^  optimizer +(\d+\.\d+) s \((\w+), (\d+\.\d)% of the step\): (.*)$", re.M)
STEP_LINE = re.compile(r"^  total +(\d+\.\d+) s\b", re.M)


def plan(config, *extra, json_out=False):
    cmd = [nnstrain_bin_path(), "plan", "--config", str(CONFIGS / config), "--vars.data", "absent.bin", *map(str, extra)]
    p = subprocess.run(cmd + (["--json"] if json_out else []), cwd=SOURCE, env=single_process_env(1),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)["plan"] if json_out else p.stdout


def optimizer_line(text):
    """The optimizer line's (type, seconds, share %, details)."""
    m = OPTIMIZER_LINE.search(text)
    assert m and STEP_LINE.search(text), text
    return m[2], float(m[1]), float(m[3]), m[4]


def check_share(text, estimate):
    """The printed share is the optimizer's step over the whole step, as estimated."""
    _, seconds, share, _ = optimizer_line(text)
    assert seconds == pytest.approx(estimate["optim_step_s"], abs=1e-4)
    assert share == pytest.approx(100 * estimate["optim_step_s"] / estimate["step_s"], abs=0.051), text
    assert estimate["step_s"] > estimate["optim_step_s"] > 0


def block_flops(ns_steps):
    """Newton-Schulz on every matrix inside the GPT's blocks: c_attn [3C, C],
    attn.c_proj [C, C], mlp.c_fc [4C, C], mlp.c_proj [C, 4C]."""
    def one(rows, cols):
        m, n = min(rows, cols), max(rows, cols)
        return ns_steps * (4 * m * m * n + 2 * m ** 3)
    c = EMBD
    return LAYERS * (one(3 * c, c) + one(c, c) + 2 * one(4 * c, c))


def test_adamw_share_is_its_element_wise_step():
    text = plan("tiny_gpt.yaml")
    kind, _, _, rest = optimizer_line(text)
    assert kind == "adamw"
    assert rest.startswith("element-wise ") and "Newton-Schulz" not in rest, rest
    one = plan("tiny_gpt.yaml", json_out=True)
    assert one["optimizer"]["type"] == "adamw"
    assert one["estimate"]["optim_matrix_flops"] == 0
    check_share(text, one["estimate"])


def test_muon_share_names_newton_schulz_and_its_flops():
    text = plan("tiny_gpt_muon.yaml")
    kind, _, _, rest = optimizer_line(text)
    assert kind == "muon"
    assert rest.startswith("Newton-Schulz (5 steps, fp32) "), rest  # fp32 on the cpu device
    one = plan("tiny_gpt_muon.yaml", json_out=True)
    assert one["optimizer"] == {"type": "muon", "work": "Newton-Schulz (5 steps, fp32)"}
    e = one["estimate"]
    check_share(text, e)
    assert e["optim_matrix_flops"] == pytest.approx(block_flops(5))
    assert e["optim_gather_bytes"] == 0 and e["optim_scatter_bytes"] == 0  # one rank: nothing moves
    assert e["optim_step_s"] == pytest.approx(e["optim_elementwise_s"] + e["optim_matrix_s"] + e["optim_exchange_s"])
    # Twice the iterations, twice the FLOPs.
    ten = plan("tiny_gpt_muon.yaml", "--optimizer.args.ns_steps", 10, json_out=True)["estimate"]
    assert ten["optim_matrix_flops"] == pytest.approx(block_flops(10))
    # Under tp 2 each owner gathers the half of its matrices it lacks (fp32: 4 bytes
    # an element); the two owners share the FLOPs evenly here (56 of 112 C^3 per iteration).
    tp_args = ["--runtime-ngpus", 2, "--pas_policy", "tp", "--compute_config.plan_ngpus", 2]
    tp = plan("tiny_gpt_muon.yaml", *tp_args, json_out=True)
    assert tp["tp"] == 2
    assert tp["estimate"]["optim_matrix_flops"] == pytest.approx(block_flops(5) / 2)
    owned = LAYERS * 12 * EMBD * EMBD / 2  # elements of the matrices one owner holds whole
    assert tp["estimate"]["optim_gather_bytes"] == pytest.approx(owned / 2 * 4)
    assert tp["estimate"]["optim_exchange_s"] > 0
    check_share(plan("tiny_gpt_muon.yaml", *tp_args), tp["estimate"])
