"""Default sizes for bench_serving: the H200 run and the CPU smoke run. Each key is a command-line
flag's destination (a flag left unset takes its preset); this file only holds numbers, it never
builds a workload or starts anything.
"""

from __future__ import annotations

GiB = 2**30

# Llama-3.1-8B on one H200 (128 KiB of KV a token, cold prefill ~37 us a token). Each workload's
# KV is --kv-over-l1 (4) x L1; l2_over_kv sets L2 against that KV: 1.25 holds the whole working
# set (multi-round, shared prefix), 0.25 leaves half the documents to the disk (long-doc).
#   multi_round   32 live conversations of 8K tokens (1K shared) + 8 rounds of 100 + 32: KV ~260K
#                 tokens (34 GB), L1 8.5 GB (~7 running requests), L2 42 GB
#   long_doc      16 documents of 8K tokens: KV 128K tokens (17 GB), L1 4.2 GB, L2 4.2 GB, disk all
#   shared_prefix 16 system prompts of 8K tokens: KV 128K tokens, L1 4.2 GB, L2 21 GB
H200 = dict(
    configs="l1,l1+l2,l1+l2+disk", workloads="multi_round,long_doc,shared_prefix",
    mr_users=32, mr_rounds=8, mr_system_tokens=1000, mr_context_tokens=7000, mr_question_tokens=100,
    mr_answer_tokens=32, mr_l2_over_kv=1.25,
    ld_docs=16, ld_doc_tokens=8000, ld_question_tokens=100, ld_answer_tokens=32, ld_l2_over_kv=0.25,
    sp_groups=16, sp_system_tokens=8000, sp_question_tokens=128, sp_answer_tokens=32, sp_l2_over_kv=1.25,
    uq_prompt_tokens=4000, uq_answer_tokens=32, uq_l2_over_kv=1.0,
    point_seconds=20.0, min_point_requests=30, drain_seconds=10.0, max_points=6, settle_seconds=20.0,
    warm_tokens=9000, disk_probe_bytes=2 * GiB, h2d_bytes=4 * GiB,
)
# A tiny Llama on a CPU: every figure is meaningless, the point is that every path runs (the
# l1+l2+disk config runs them all; one server start is ~13 s on a 2-core box).
SMOKE = dict(
    configs="l1+l2+disk", workloads="multi_round,long_doc,shared_prefix",
    mr_users=8, mr_rounds=4, mr_system_tokens=32, mr_context_tokens=96, mr_question_tokens=16,
    mr_answer_tokens=4, mr_l2_over_kv=1.25,
    ld_docs=8, ld_doc_tokens=160, ld_question_tokens=16, ld_answer_tokens=4, ld_l2_over_kv=0.25,
    sp_groups=8, sp_system_tokens=160, sp_question_tokens=16, sp_answer_tokens=4, sp_l2_over_kv=1.25,
    uq_prompt_tokens=64, uq_answer_tokens=4, uq_l2_over_kv=1.0,
    point_seconds=1.5, min_point_requests=0, drain_seconds=1.5, max_points=2, settle_seconds=2.0,
    warm_tokens=128, disk_probe_bytes=32 * 2**20, h2d_bytes=64 * 2**20,
)
