"""Reference numbers for nnstrain's Llama from Hugging Face transformers.

Run by tests/unit/test_llama.cpp ([llama][parity]):

    llama_reference.py OUTDIR [--attn sdpa|eager] [--seed N] [--batch B] [--seq T]

Reads OUTDIR/ours_config.json (nnstrain's hf_config() of the model under test),
builds a LlamaForCausalLM from it in fp32 with transformers' own initialisation
(plus noise on the norm weights and biases, so their gradients are not trivial),
and writes:
  OUTDIR/hf/                      save_pretrained(): config.json + model.safetensors
  OUTDIR/reference.safetensors    input_ids, targets [B, T] int64; loss [1];
                                  inv_freq (the rotary frequencies);
                                  "grad.<HF name>" for every parameter
The loss is the mean next-token cross-entropy of the logits against `targets`
(two of them set to -100, which both sides ignore).
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    cfg = LlamaConfig.from_json_file(os.path.join(args.outdir, "ours_config.json"))
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=args.attn).float()
    model.train()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))

    vocab = cfg.vocab_size
    input_ids = torch.randint(0, vocab, (args.batch, args.seq))
    targets = torch.randint(0, vocab, (args.batch, args.seq))
    targets[0, 1] = -100
    targets[-1, -1] = -100

    logits = model(input_ids=input_ids).logits
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
    loss.backward()

    model.save_pretrained(os.path.join(args.outdir, "hf"))
    ref = {
        "input_ids": input_ids,
        "targets": targets,
        "loss": loss.detach().reshape(1),
        "inv_freq": model.model.rotary_emb.inv_freq.detach().clone(),
    }
    for name, p in model.named_parameters():  # a tied lm_head appears once, as embed_tokens
        ref["grad." + name] = p.grad.detach().contiguous()
    save_file(ref, os.path.join(args.outdir, "reference.safetensors"))
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                      "attn": args.attn, "rope": cfg.rope_parameters, "loss": loss.item()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
