#!/usr/bin/env python3
"""The MFU denominator, measured in the same run: the rate of one large bf16
matrix product (torch.matmul, i.e. cuBLAS) on random normal data.

--size N multiplies two N x N matrices (default 8192, 2 N^3 FLOPs each);
--warmup untimed products, then --repeats products each timed with CUDA events
(on CPU: perf_counter, fp32). Prints one JSON line: the median, max and every
rate in TFLOP/s.
"""
import argparse
import json
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(a.size, a.size, device=dev, dtype=dtype, generator=g)
    y = torch.randn(a.size, a.size, device=dev, dtype=dtype, generator=g)
    flops = 2.0 * a.size ** 3
    for _ in range(a.warmup):
        torch.matmul(x, y)
    rates = []
    for _ in range(a.repeats):
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.matmul(x, y)
            e1.record()
            e1.synchronize()
            secs = e0.elapsed_time(e1) / 1000.0
        else:
            t0 = time.perf_counter()
            torch.matmul(x, y)
            secs = time.perf_counter() - t0
        rates.append(flops / secs / 1e12)
    print(json.dumps({"size": a.size, "dtype": str(dtype).replace("torch.", ""), "device": str(dev),
                      "tflops_median": statistics.median(rates), "tflops_max": max(rates),
                      "tflops_all": [round(r, 2) for r in rates]}), flush=True)


if __name__ == "__main__":
    main()
