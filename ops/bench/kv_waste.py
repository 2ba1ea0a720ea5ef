"""KV slots wasted by paged allocation vs contiguous max-length preallocation, same workload.

    python -m ops.bench.kv_waste [--requests 512] [--max-len 4096] [--block-size 16] [--seed 0]

Drives the real KVCacheManager: each request arrives with a prompt, then grows one token per step
to its final length (lengths uniform in 1..max-len, prompt a random part of it), and leaves when
done. Waste (allocated slots holding no live token, over allocated slots) is sampled every step.
A contiguous allocator reserves max-len slots per request up front, as systems before
PagedAttention did.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from worker.engine.kv_cache import KVCacheManager


def simulate(requests: int, max_len: int, block_size: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    finals = [rng.randint(1, max_len) for _ in range(requests)]
    prompts = [rng.randint(1, n) for n in finals]
    kv = KVCacheManager(concurrency * (-(-max_len // block_size)), block_size, enable_prefix_caching=False, watermark=0)
    pending = list(range(requests))
    live: dict[int, int] = {}  # request -> tokens held
    paged, contiguous = [], []
    while pending or live:
        while pending and len(live) < concurrency:
            r = pending.pop()
            assert kv.allocate(r, prompts[r])
            live[r] = prompts[r]
        for r in list(live):
            if live[r] >= finals[r]:
                kv.free(r)
                del live[r]
            else:
                live[r] += 1
                assert kv.allocate(r, live[r])
        if live:
            paged.append(kv.stats().waste)
            held = sum(live.values())
            contiguous.append(1 - held / (len(live) * max_len))
    return {
        "requests": requests,
        "max_len": max_len,
        "block_size": block_size,
        "concurrency": concurrency,
        "paged_waste_mean": statistics.fmean(paged),
        "paged_waste_max": max(paged),
        "contiguous_waste_mean": statistics.fmean(contiguous),
        # Requests of this workload's mean length a fixed budget of `concurrency * max_len` slots holds.
        "fit_paged": int(concurrency * max_len / (statistics.fmean(finals) * (1 + statistics.fmean(paged)))),
        "fit_contiguous": concurrency,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = simulate(args.requests, args.max_len, args.block_size, args.concurrency, args.seed)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"workload: {res['requests']} requests, lengths 1..{res['max_len']}, block size {res['block_size']}")
        print(f"paged allocation      waste: {res['paged_waste_mean']:.2%} mean, {res['paged_waste_max']:.2%} max")
        print(f"contiguous max-length waste: {res['contiguous_waste_mean']:.2%} mean")
        print(f"requests held by the same budget: paged {res['fit_paged']}, contiguous {res['fit_contiguous']}")
    return res


if __name__ == "__main__":
    main()
