"""Many questions over one long template through `tierkv.LLM`: the template is computed once.

Runs the same batch with prefix caching off and on, prints the prefix-hit rate and the time
each took, and checks that both gave the same answers (greedy).
Run: python examples/shared_prefix_batch.py [--model HF_DIR] [--questions 8]
"""

import argparse
import time

import tierkv

TEMPLATE = (
    "You are a support assistant for the Tierkv Railway. Answer in one short sentence.\n"
    "Timetable: trains leave the Central station for the Harbour at 06:10, 07:40, 09:15, 11:30, "
    "13:05, 15:20, 17:45 and 20:10. The trip takes 42 minutes. Trains to the Airport leave at "
    "05:55, 08:25, 12:00, 16:35 and 21:50 and take 58 minutes. Bicycles travel free outside "
    "07:00-09:00 and 16:00-18:30. Tickets bought on board cost 2 euros more. Children under six "
    "travel free; students pay half. Dogs on a leash travel free; other pets need a carrier. "
    "Lost property is kept for 30 days at the Central station, desk 4, open 08:00-19:00. "
) * 3 + "\nQuestion: "

QUESTIONS = [
    "When does the first train to the Harbour leave?",
    "How long is the trip to the Airport?",
    "Can I bring my bicycle at 08:30?",
    "Do children pay?",
    "Where is lost property kept?",
    "What does a ticket bought on board cost extra?",
    "When is the last train to the Airport?",
    "Can my cat travel without a carrier?",
    "How much do students pay?",
    "When does the desk for lost property close?",
]


def run(llm: tierkv.LLM, prompts: list[str]) -> tuple[list, float]:
    params = tierkv.SamplingParams(temperature=0, max_tokens=12)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face model directory (default: the bundled SmolLM2)")
    ap.add_argument("--questions", type=int, default=8)
    args = ap.parse_args()
    prompts = [TEMPLATE + q + "\nAnswer:" for q in (QUESTIONS * 2)[: args.questions]]

    results = {}
    for caching in (False, True):
        llm = tierkv.LLM(args.model, enable_prefix_caching=caching)
        run(llm, prompts[:1])  # warm-up: first-call costs (and, with caching on, the template's KV)
        outs, seconds = run(llm, prompts)
        stats = llm.cache.stats()
        results[caching] = (outs, seconds)
        cached = sum(o.cached_tokens for o in outs)
        total = sum(len(o.prompt_token_ids) for o in outs)
        print(f"prefix caching {'on ' if caching else 'off'}: {seconds:6.2f} s for {len(prompts)} questions; "
              f"cached {cached} of {total} prompt tokens (hit rate {cached / total:.2f}); "
              f"L1 hits {stats['tiers']['l1']['hit_tokens']} tokens")
        llm.close()
    same = [o.token_ids for o in results[False][0]] == [o.token_ids for o in results[True][0]]
    print(f"time saved by caching: {1 - results[True][1] / results[False][1]:.0%}; same answers: {same}")
    for q, o in list(zip(QUESTIONS, results[True][0]))[:3]:
        print(f"Q: {q}\nA:{o.text.strip()[:80]}")


if __name__ == "__main__":
    main()
