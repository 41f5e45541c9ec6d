"""Several questions over one long document; from the second question on, the document's KV is reused.

The cache has a disk tier (L3), so the document's blocks outlive the script: run it twice and
the second run's first question finds the document on disk instead of computing it again.
Run: python examples/long_document_qa.py [--model HF_DIR] [--disk DIR]   (twice, to see the disk hit)
"""

import argparse
import time
from pathlib import Path

import tierkv

DOCUMENT = "\n".join(
    f"Section {i}. The lighthouse keeper's log for week {i}: the lamp was cleaned on day {i % 7 + 1}, "
    f"{3 + i % 5} ships passed, the wind came from the {['north', 'east', 'south', 'west'][i % 4]}, "
    f"and the supply boat brought {10 + i} litres of oil."
    for i in range(1, 25)
)
QUESTIONS = [
    "In which week did the supply boat bring 20 litres of oil?",
    "Where did the wind come from in week 3?",
    "How many ships passed in week 5?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face model directory (default: the bundled SmolLM2)")
    ap.add_argument("--disk", default=str(Path.home() / ".cache" / "tierkv" / "long_document_qa"),
                    help="directory of the disk tier")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    Path(args.disk).mkdir(parents=True, exist_ok=True)
    # A small L1 and L2 next to a disk tier: what matters here is that the disk outlives the process.
    llm = tierkv.LLM(args.model, l1="256MiB", l2="256MiB", l3=[f"file://{args.disk}?size=2GiB"])
    params = tierkv.SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for q in QUESTIONS:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": DOCUMENT + "\n\n" + q}])
        where = llm.cache.match(prompt).by_tier  # where the document's blocks are before this question
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        print(f"Q: {q}\n   prompt {len(prompt)} tokens, cached {out.cached_tokens} "
              f"(l1 {where['l1']}, l2 {where['l2']}, l3 {where['l3']}), {seconds:.2f} s\n   A: {out.text.strip()[:100]}")
    llm.cache.flush(timeout=60)  # everything on disk before exit, so the next run finds it
    llm.close()


if __name__ == "__main__":
    main()
