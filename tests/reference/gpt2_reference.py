"""Reference for tests/unit/test_gpt_parity.cpp: Hugging Face GPT2LMHeadModel.

Usage: gpt2_reference.py OUT_DIR

Builds a small GPT2LMHeadModel (fp32, biases, no dropout, exact GELU as nanoGPT's
nn.GELU, eager attention), fills every parameter with seeded random values (LayerNorm
gains and all biases too, so a misplaced bias or gain changes the loss), runs a random
batch forward and backward and writes to OUT_DIR:

  weights.safetensors   every parameter under its HF name (lm_head is tied to wte)
  batch.safetensors     x, y: int64 [3, 32]
  expected.safetensors  loss (scalar), logits [3, 32, vocab], grad/<HF name> per parameter,
                        and tied/* from an untied copy of the model, whose wte gradient is
                        the embedding's share alone and lm_head's the head's share alone.

The loss is ours, not HF's shifted one: mean cross-entropy of logits(x) against y.
"""

import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, BLOCK, N_LAYER, N_HEAD, N_EMBD = 97, 32, 2, 4, 64
BATCH = 3


def build(tied: bool) -> GPT2LMHeadModel:
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=N_EMBD, n_layer=N_LAYER,
                     n_head=N_HEAD, activation_function="gelu", resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied,
                     attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).float().train()  # train(): dropouts are 0 anyway
    assert model.config._attn_implementation == "eager"
    return model


def loss_of(model, x, y):
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)), logits


def main() -> None:
    out = sys.argv[1]
    torch.manual_seed(20240611)
    model = build(tied=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    x = torch.randint(0, VOCAB, (BATCH, BLOCK), dtype=torch.int64)
    y = torch.randint(0, VOCAB, (BATCH, BLOCK), dtype=torch.int64)

    loss, logits = loss_of(model, x, y)
    loss.backward()
    weights = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    expected = {"loss": loss.detach().clone(), "logits": logits.detach().contiguous()}
    for n, p in model.named_parameters():
        expected["grad/" + n] = p.grad.detach().clone().contiguous()

    # The same weights with the head untied: wte's gradient is then the embedding's
    # share alone, lm_head's the head's share alone; tied = their sum.
    untied = build(tied=False)
    with torch.no_grad():
        for n, p in untied.named_parameters():
            p.copy_(weights["transformer.wte.weight"] if n == "lm_head.weight" else weights[n])
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    uloss, _ = loss_of(untied, x, y)
    uloss.backward()
    expected["tied/loss"] = uloss.detach().clone()
    expected["tied/wte_embedding_grad"] = untied.transformer.wte.weight.grad.detach().clone()
    expected["tied/lm_head_grad"] = untied.lm_head.weight.grad.detach().clone()

    save_file(weights, f"{out}/weights.safetensors")
    save_file({"x": x, "y": y}, f"{out}/batch.safetensors")
    save_file(expected, f"{out}/expected.safetensors")


if __name__ == "__main__":
    main()
