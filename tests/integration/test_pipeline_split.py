"""The zero-bubble schedules with the real split backward (issue 21): I computes
the input's gradient and leaves the linears' (input, output gradient) pairs, W
makes only the weights' gradients (models/common/weight_grad.h; that W runs no
part of the chain again is counted in tests/unit/test_split_backward.cpp).

Parity with one process, as test_pipeline.py (fp32, 10 steps, clipping active,
loss and gradient norm within 1e-5 relative), where the split meets the rest:
recompute (a block's second forward runs inside I), pp2 x tp2 with sequence
parallelism (the column-parallel linears' input gathered again in W), the
chunked and fused heads, a GPT with its tied head (the embedding's gradient
from I, the head's from W, on one rank under zbv), pp4.
"""
import pathlib

import pytest

from conftest import TEST_DEVICE, active_records, assert_active, loss_ran
from test_pipeline import assert_close_on_cpu, assert_pipelined, compare, reference, run  # noqa: F401 (reference: a fixture)

PP2_TP2_SP = ["--compute_config.plan_ngpus", "2", "--pas_policy", "hybrid", "--compute_config.sequence_parallel",
              "true"]
RECOMPUTE = ["--model.activation_checkpointing", "true"]

CASES = {  # id: (model, scheduler, world, pipeline ranks, overrides)
    "gpt_zb1p_pp2_recompute": ("gpt", "zb1p", 2, 2, RECOMPUTE),
    "llama_zbv_pp2_recompute": ("llama", "zbv", 2, 2, RECOMPUTE),
    "llama_zb1p_pp2_tp2_sp": ("llama", "zb1p", 4, 2, PP2_TP2_SP),
    "llama_zbv_pp2_tp2_sp_recompute": ("llama", "zbv", 4, 2, PP2_TP2_SP + RECOMPUTE),
    "gpt_zbv_pp2_chunked": ("gpt", "zbv", 2, 2, ["--model.loss", "chunked", "--model.loss_chunk_size", "24"]),
    "llama_zb1p_pp4_fused": ("llama", "zb1p", 4, 4, ["--model.loss", "fused", "--model.loss_chunk_size", "24"]),
}


def split_lines(run_dir, ranks):
    """Each rank's log line saying its backward is split."""
    out = []
    for r in range(ranks):
        log = (pathlib.Path(run_dir) / "logs" / f"rank{r}.log").read_text()
        out.append([line for line in log.splitlines() if "backward split into I and W" in line])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_split_backward_parity(reference, tmp_path, tiny_tokens, case):
    model, scheduler, world, pp, extra = CASES[case]
    ref = reference(model)
    kind = "plain"
    if "--model.loss" in extra:  # against one process with the same head (chunked and fused sum in another order)
        loss = extra[extra.index("--model.loss"):]
        kind = loss[1]
        ref, _ = run(1, tmp_path / "one", tiny_tokens, model, *loss)
        loss_ran(active_records(tmp_path / "one", 1), kind)
        tmp_path = tmp_path / "pp"
    ov = ["--compute_config.pas_config.pp_size", str(pp), "--compute_config.pas_config.pipeline_scheduler", scheduler,
          *extra]
    got, out = run(world, tmp_path, tiny_tokens, model, *ov)
    if world == pp:
        assert_pipelined(tmp_path, pp, scheduler, model, 2 * pp if scheduler == "zbv" else pp)
    else:
        assert_active(tmp_path, out, world, ov)  # tp traffic with SP's reduce-scatters
    # Every rank split its backward (recompute included: it used to fall back to a whole one in I).
    lines = split_lines(tmp_path, world)
    assert all(lines), f"a rank did not split its backward: {lines}\n{out}"
    # The head asked for ran on the last stage's ranks (every tp rank of it), once per micro-batch.
    assert loss_ran(active_records(tmp_path, world), kind) == world // pp
    compare(ref, got, f"{model} {case}")


def test_split_backward_bf16_mixed(tmp_path, tiny_tokens):
    """bf16-mixed: W's gradients reach the fp32 slots through the accumulators' hooks (the
    parameters are bf16). zbv pp2 against bf16-mixed one process, within test_precision's
    bf16 tolerance, as test_pipeline's bf16 test does for 1f1b."""
    from test_pipeline import rel
    from test_precision import BF16_RTOL
    bf16 = ["--precision", "bf16-mixed"]
    one, _ = run(1, tmp_path / "one", tiny_tokens, "gpt", *bf16)
    pp = ["--compute_config.pas_config.pp_size", "2", "--compute_config.pas_config.pipeline_scheduler", "zbv"]
    got, out = run(2, tmp_path / "pp2", tiny_tokens, "gpt", *bf16, *pp)
    assert_active(tmp_path / "pp2", out, 2, [*bf16, *pp])
    assert all(split_lines(tmp_path / "pp2", 2)), out
    worst_loss = max(rel(got[s][0], one[s][0]) for s in one)
    worst_norm = max(rel(got[s][1], one[s][1]) for s in one)
    print(f"bf16-mixed zbv pp2: largest relative difference loss {worst_loss:.2e}, grad norm {worst_norm:.2e}")
    assert worst_loss <= BF16_RTOL and worst_norm <= 4 * BF16_RTOL


def test_split_backward_bf16_mixed_untied_llama_is_exact(tmp_path, tiny_tokens):
    """The exact companion of the GPT case above (whose tied embedding puts its norm at 75% of the
    tolerance, where a dropped micro-batch would pass): the untied Llama (4 layers) under zb1p pp2,
    its W's gradients through the accumulators' hooks, matches one process to the last bit on CPU:
    the losses bitwise, the gradient norm (summed over the stages in another order) within 1e-6
    (6e-8 relative seen; zbv's V order moves further, 6e-5). A dropped micro-batch moves both by
    percents."""
    from test_precision import BF16_RTOL
    bf16 = ["--precision", "bf16-mixed"]
    pp = ["--compute_config.pas_config.pp_size", "2", "--compute_config.pas_config.pipeline_scheduler", "zb1p"]
    one, _ = run(1, tmp_path / "one", tiny_tokens, "llama", *bf16, layers=4)
    got, out = run(2, tmp_path / "pp2", tiny_tokens, "llama", *bf16, *pp, layers=4)
    assert_active(tmp_path / "pp2", out, 2, [*bf16, *pp])
    assert all(split_lines(tmp_path / "pp2", 2)), out
    assert all(got[s][0] == one[s][0] for s in one) or TEST_DEVICE != "cpu", (got, one)  # the losses bitwise
    assert_close_on_cpu(one, got, 1e-6, BF16_RTOL, "bf16-mixed llama zb1p pp2")
