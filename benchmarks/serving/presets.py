"""Default sizes for bench_serving: the H200 run and the CPU smoke run. Each key is a command-line
flag's destination (a flag left unset takes its preset); this file only holds numbers, it never
builds a trace or starts anything.
"""

from __future__ import annotations

import math

GiB = 2**30

# Defaults sized for Llama-3.1-8B on one H200 (128 KiB of KV a token): KV 85-102K tokens per workload,
# so L1 ~25K tokens (3.1 GiB, one 20K document); the off config (everything cold, ~1M prefill
# tokens) then takes about a minute, and four configs with their server starts ~6-8 minutes.
# Multi-round users arrive fast (16/s) so that the active-user limit, not the arrival process, sets
# the load: its throughput then measures the server.
H200 = dict(
    mr_users=32, mr_rounds=3, mr_system_tokens=1000, mr_context_tokens=2000, mr_question_tokens=150,
    mr_answer_tokens=64, mr_rate=16.0, mr_think_time=0.5, mr_max_active_users=12,
    ld_docs=5, ld_doc_tokens=20000, ld_questions=3, ld_question_tokens=100, ld_answer_tokens=32, ld_concurrency=2,
    sp_groups=16, sp_system_tokens=5000, sp_questions=4, sp_question_tokens=128, sp_answer_tokens=64,
    sp_rate=math.inf, sp_concurrency=16,
    uq_prompts=64, uq_prompt_tokens=1024, uq_answer_tokens=128, uq_concurrency=64,
    probe_tokens=12000, max_seconds=60.0, config_seconds=120.0, disk_probe_bytes=2 * GiB, h2d_bytes=4 * GiB,
)
# A tiny Llama on a CPU: every figure is meaningless, the point is that every path runs.
SMOKE = dict(
    mr_users=6, mr_rounds=2, mr_system_tokens=64, mr_context_tokens=96, mr_question_tokens=16,
    mr_answer_tokens=4, mr_rate=50.0, mr_think_time=0.01, mr_max_active_users=3,
    ld_docs=4, ld_doc_tokens=192, ld_questions=2, ld_question_tokens=16, ld_answer_tokens=4, ld_concurrency=2,
    sp_groups=4, sp_system_tokens=160, sp_questions=3, sp_question_tokens=16, sp_answer_tokens=4,
    sp_rate=math.inf, sp_concurrency=4,
    uq_prompts=8, uq_prompt_tokens=64, uq_answer_tokens=4, uq_concurrency=8,
    probe_tokens=192, max_seconds=60.0, config_seconds=120.0, disk_probe_bytes=32 * 2**20, h2d_bytes=64 * 2**20,
)
