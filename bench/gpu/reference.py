#!/usr/bin/env python3
"""The PyTorch baseline of the GPU battery: a plain training loop in Python.

Two models, written here from their papers' and nanoGPT's descriptions (nobody
on the project wrote them):
  gpt    nanoGPT's GPT: token + position embeddings, pre-LN blocks, causal
         F.scaled_dot_product_attention, GELU MLP, tied head, nanoGPT's init;
  llama  a Llama 3 decoder: RMSNorm (F.rms_norm), rotary embeddings (fp32),
         grouped-query attention through SDPA (enable_gqa), SwiGLU MLP, tied or
         untied head.
The loop is nanoGPT's train.py on one GPU: bf16 autocast over fp32 weights,
torch.optim.AdamW(fused=True) with two weight-decay groups (dim >= 2 decayed),
nanoGPT's warmup + cosine lr, clip_grad_norm_, random windows of a token file
copied through pinned memory, the next batch fetched while the GPU works,
loss.item() only every --log-every steps (as nnstrain syncs only at logging
steps); --mode compile wraps the model in torch.compile as nanoGPT does.

Timing: --warmup steps first (they include compilation), then --steps timed
steps between two CUDA events (the mean ms/step), and the host time of every
--log-every interval (its median, as nnstrain's metrics records give). Prints
one JSON line; exit 3 when the batch does not fit in memory. --profile PATH:
after the timed steps, --profile-steps more run under torch.profiler (CPU and
CUDA activities; untimed, so the timings carry no profiler overhead) and its
Chrome trace is written to PATH (the battery's kernel tables).

The driver (driver.py) passes the shapes it reads from nnstrain's resolved
config, so both train the same model on the same data.
"""
import argparse
import json
import math
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class GptBlock(nn.Module):
    def __init__(self, c, n_head, bias, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1 = nn.LayerNorm(c, bias=bias)
        self.c_attn = nn.Linear(c, 3 * c, bias=bias)
        self.attn_proj = nn.Linear(c, c, bias=bias)
        self.ln_2 = nn.LayerNorm(c, bias=bias)
        self.c_fc = nn.Linear(c, 4 * c, bias=bias)
        self.c_proj = nn.Linear(4 * c, c, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        x = x + self.drop(self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        return x + self.drop(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class Gpt(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GptBlock(n_embd, n_head, bias, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():  # GPT-2's scaled residual projections
            if name.endswith("c_proj.weight") or name.endswith("attn_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def rotate_half(t):
    a, b = t.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, c, n_head, n_kv, head_dim, ffn, eps):
        super().__init__()
        self.n_head, self.n_kv, self.hd, self.eps = n_head, n_kv, head_dim, eps
        self.input_layernorm = nn.Parameter(torch.ones(c))
        self.q_proj = nn.Linear(c, n_head * head_dim, bias=False)
        self.k_proj = nn.Linear(c, n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(c, n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * head_dim, c, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(c))
        self.gate_proj = nn.Linear(c, ffn, bias=False)
        self.up_proj = nn.Linear(c, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, c, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        h = F.rms_norm(x, (C,), self.input_layernorm, self.eps)
        q = self.q_proj(h).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        # GQA: the flash kernel takes the KV heads as they are (CUDA, 16-bit); elsewhere
        # enable_gqa would fall back to the math kernel, so repeat them (HF's repeat_kv).
        native = self.n_kv != self.n_head and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
        if self.n_kv != self.n_head and not native:
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=native)
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.hd))
        h = F.rms_norm(x, (C,), self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
                 num_key_value_heads, head_dim, rope_theta, rms_norm_eps, tie_word_embeddings, seq_len,
                 initializer_range=0.02):
        super().__init__()
        self.eps = rms_norm_eps
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            LlamaBlock(hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
                       rms_norm_eps) for _ in range(num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(hidden_size))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, initializer_range)
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, idx, targets):
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(F.rms_norm(x, (x.size(-1),), self.norm, self.eps))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_model(a):
    if a.model == "gpt":
        return Gpt(a.vocab_size, a.seq_len, a.n_layer, a.n_head, a.n_embd, a.dropout, a.bias)
    return Llama(a.vocab_size, a.n_embd, a.ffn, a.n_layer, a.n_head, a.n_kv_head, a.head_dim, a.rope_theta,
                 a.norm_eps, a.tie, a.seq_len)


def lr_at(it, a):  # nanoGPT's get_lr
    if it < a.warmup_iters:
        return a.lr * (it + 1) / (a.warmup_iters + 1)
    if it > a.lr_decay_iters:
        return a.min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - a.warmup_iters) / (a.lr_decay_iters - a.warmup_iters)))
    return a.min_lr + coeff * (a.lr - a.min_lr)


def run(a):
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(a.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT
        torch.backends.cudnn.allow_tf32 = True
    data = np.memmap(a.data, dtype=np.dtype(a.dtype), mode="r")
    B, T = a.batch, a.seq_len

    def get_batch():
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        if cuda:
            return x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
        return x, y

    model = build_model(a).to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, fused=True)
    step_model = torch.compile(model) if a.mode == "compile" else model
    amp = torch.amp.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=a.bf16)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    total = a.warmup + a.steps
    t_start = time.perf_counter()
    first_step_s = None
    ev0 = ev1 = None
    t0 = None
    intervals, losses = [], []
    t_prev = None
    x, y = get_batch()

    def train_step(it):
        nonlocal x, y
        for g in opt.param_groups:
            g["lr"] = lr_at(it, a)
        with amp:
            loss = step_model(x, y)
        x, y = get_batch()  # next batch while the GPU works (nanoGPT)
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for it in range(total):
        if it == a.warmup:
            sync()
            t0 = t_prev = time.perf_counter()
            if cuda:
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
        loss = train_step(it)
        if it == 0:
            losses.append(loss.item())
            first_step_s = time.perf_counter() - t_start  # includes compilation under --mode compile
        if (it + 1) % a.log_every == 0 or it + 1 == total:
            losses.append(loss.item())  # the host sync of a logging step
            if it >= a.warmup:
                now = time.perf_counter()
                n = (it + 1 - a.warmup) - sum(k for k, _ in intervals)
                intervals.append((n, (now - t_prev) * 1000.0 / n))
                t_prev = now
    if cuda:
        ev1.record()
    sync()
    wall_ms = (time.perf_counter() - t0) * 1000.0 / a.steps
    ms = ev0.elapsed_time(ev1) / a.steps if cuda else wall_ms
    tokens = B * T
    out = {"model": a.model, "mode": a.mode, "device": str(dev), "batch": B, "seq_len": T, "params": n_params,
           "bf16_autocast": a.bf16, "warmup_steps": a.warmup, "timed_steps": a.steps,
           "ms_per_step": ms, "ms_per_step_wall": wall_ms,
           "ms_per_step_median_interval": statistics.median(v for _, v in intervals) if intervals else ms,
           "tokens_per_s": tokens / ms * 1000.0, "first_step_s": first_step_s,
           "loss_first": losses[0], "loss_last": losses[-1]}
    if cuda:
        out["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    if a.profile and a.profile_steps > 0:  # after the timing: its figures above are the profiler's-free ones
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        try:  # a profiler failure costs the trace, never the timings above
            with torch.profiler.profile(activities=acts) as prof:
                for it in range(total, total + a.profile_steps):
                    train_step(it)
                sync()
            prof.export_chrome_trace(a.profile)
            out["profile_trace"], out["profiled_steps"] = a.profile, a.profile_steps
        except Exception as e:  # noqa: BLE001 (reported, not hidden)
            out["profile_error"] = repr(e)[:400]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["gpt", "llama"], required=True)
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data", required=True, help="token file (nanoGPT format)")
    ap.add_argument("--dtype", choices=["uint16", "uint32"], default="uint16")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--n-layer", type=int, required=True)
    ap.add_argument("--n-head", type=int, required=True)
    ap.add_argument("--n-embd", type=int, required=True)
    ap.add_argument("--n-kv-head", type=int, default=0, help="llama")
    ap.add_argument("--head-dim", type=int, default=0, help="llama")
    ap.add_argument("--ffn", type=int, default=0, help="llama: intermediate size")
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--norm-eps", type=float, default=1e-5)
    ap.add_argument("--tie", action="store_true", help="llama: tied embeddings (gpt always ties)")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup-iters", type=int, default=100)
    ap.add_argument("--lr-decay-iters", type=int, default=5000)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (bf16-mixed)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed first steps")
    ap.add_argument("--steps", type=int, default=100, help="timed steps")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--profile", default="", help="write a torch.profiler Chrome trace of --profile-steps "
                    "steps after the timed ones here")
    ap.add_argument("--profile-steps", type=int, default=2, help="steps profiled after the timed ones")
    a = ap.parse_args()
    if a.model == "llama":
        a.head_dim = a.head_dim or a.n_embd // a.n_head
        a.n_kv_head = a.n_kv_head or a.n_head
    try:
        out = run(a)
    except torch.OutOfMemoryError as e:
        print(json.dumps({"oom": True, "batch": a.batch, "error": str(e).splitlines()[0]}), flush=True)
        sys.exit(3)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
