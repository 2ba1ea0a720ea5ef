"""What logprobs' token texts cost (issue 47): offline `LLM.generate` throughput with logprobs=5, the
texts on and off, alternated in one process on the same engine (the off runs skip exactly the code the
texts add: `OutputProcessor.texts = None`).

    .venv/bin/python -m ops.bench.logprob_texts --model tiny --rounds 5
    .venv/bin/python -m ops.bench.logprob_texts --model smollm2 --rounds 5

Prints per round the generated tokens/s of each mode, then the median, spread and relative cost.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def _model_dir(name: str) -> str:
    if name == "tiny":
        from worker.models.tiny import build_tiny_model

        return str(build_tiny_model("llama", tempfile.mkdtemp(prefix="pagedq-lp-bench-"), seed=0))
    if name == "smollm2":
        from worker.models.prepare import prepare

        return str(prepare("smollm2"))
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, smollm2, or a model folder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--logprobs", type=int, default=5)
    args = p.parse_args()

    from worker import LLM, SamplingParams

    llm = LLM(model=_model_dir(args.model), dtype="float32", device="cpu")
    proc = llm.engine.output_processor
    texts = proc.texts
    spent = [0.0]  # seconds inside the texts' code (the on runs)
    add_texts = proc._add_texts

    def timed_add_texts(seq, token, top):
        t0 = time.perf_counter()
        add_texts(seq, token, top)
        spent[0] += time.perf_counter() - t0

    proc._add_texts = timed_add_texts
    shares: list[float] = []
    prompts = [f"Request {i}: tell me about paged attention and 日本語 🚀." for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, logprobs=args.logprobs)

    def run(on: bool) -> tuple[float, float]:
        """(tokens per wall second, tokens per CPU second of this process)."""
        proc.texts = texts if on else None
        spent[0] = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if on:
            shares.append(spent[0] / dt * 100)
        assert (outs[0].outputs[0].token_texts is not None) == on
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        return n / dt, n / dc

    run(True)  # warm up (tables, caches)
    run(False)
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for i in range(args.rounds):
        for on in (False, True) if i % 2 == 0 else (True, False):
            results[on].append(run(on))
        (w0, c0), (w1, c1) = results[False][-1], results[True][-1]
        print(f"round {i}: off {w0:.0f} tok/s ({c0:.0f}/CPU s), on {w1:.0f} tok/s ({c1:.0f}/CPU s)", flush=True)
    for k, unit in ((0, "tok/s"), (1, "tok per CPU s")):
        off = [r[k] for r in results[False]]
        on = [r[k] for r in results[True]]
        for name, r in (("off", off), ("on", on)):
            print(f"{unit}: {name} median {statistics.median(r):.0f}, min {min(r):.0f}, max {max(r):.0f}")
        mo, mn = statistics.median(off), statistics.median(on)
        pairs = ", ".join(f"{(a - b) / a * 100:+.1f}%" for a, b in zip(off, on, strict=True))
        print(f"{unit}: cost {(mo - mn) / mo * 100:+.2f}% of the median; per round {pairs}")
    shares = shares[1:]  # the warm-up run filled the tables
    print(
        f"time inside the token texts' code (timer included), share of each on run: median "
        f"{statistics.median(shares):.2f}%, min {min(shares):.2f}%, max {max(shares):.2f}%"
    )


if __name__ == "__main__":
    main()
