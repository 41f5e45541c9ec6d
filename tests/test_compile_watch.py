"""CompileWatch: Triton compilations after start-up are counted, timed and named, hooks set
before it keep being called, and the engine exports the count on /metrics."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")

from tierkv.kernels.compile_watch import CompileWatch  # noqa: E402


@pytest.fixture
def clean_hooks():
    """Triton's two hook slots as the test found them, restored after it."""
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    yield knobs.runtime
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def compile_through(runtime, name: str) -> None:
    """What Triton's JITFunction._do_compile does around one compile: the cache hook, then the post hook."""
    assert runtime.jit_cache_hook(key="k", repr=name, fn=None, compile={}, is_manual_warmup=False,
                                  already_compiled=False) is None
    runtime.jit_post_compile_hook(key="k", repr=name, fn=None, compile={}, is_manual_warmup=False,
                                  already_compiled=False)


def test_counts_names_and_chains_to_the_hooks_set_before(clean_hooks, caplog):
    seen = []
    clean_hooks.jit_cache_hook = lambda **kw: seen.append(("before", kw["repr"]))
    clean_hooks.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["repr"]))
    watch = CompileWatch()
    assert watch.arm() and watch.armed
    with caplog.at_level("WARNING"):
        compile_through(clean_hooks, "decode_kernel[num_warps=4](n: i32)")
    assert watch.count == 1 and watch.seconds >= 0.0
    assert watch.stats()["recent"][0]["kernel"] == "decode_kernel[num_warps=4](n: i32)"
    assert seen == [("before", "decode_kernel[num_warps=4](n: i32)"), ("after", "decode_kernel[num_warps=4](n: i32)")]
    assert "decode_kernel" in caplog.text and "warm-up missed" in caplog.text
    watch.disarm()
    assert not watch.armed
    compile_through(clean_hooks, "other")  # the user's hooks are back, this watch no longer counts
    assert watch.count == 1 and seen[-1] == ("after", "other")


def test_a_hook_that_skips_the_compile_is_still_obeyed(clean_hooks):
    """Triton skips a compile when the cache hook answers truthy: the watch must pass that on."""
    clean_hooks.jit_cache_hook = lambda **kw: True
    watch = CompileWatch()
    watch.arm()
    assert clean_hooks.jit_cache_hook(key="k", repr="x", fn=None, compile={}, is_manual_warmup=False,
                                      already_compiled=False) is True
    watch.disarm()


def test_a_second_watch_chains_and_the_first_disarm_leaves_it_in_place(clean_hooks):
    first, second = CompileWatch(), CompileWatch()
    first.arm()
    second.arm()
    first.disarm()  # not the installed one: the second's hooks stay, and still call through the first's
    assert clean_hooks.jit_post_compile_hook == second._on_done
    compile_through(clean_hooks, "k")
    assert second.count == 1
    second.disarm()
    assert clean_hooks.jit_post_compile_hook is not second._on_done


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_compile_on_the_gpu_is_counted(clean_hooks):
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    watch = CompileWatch()
    watch.arm()
    x = torch.zeros(16, device="cuda")
    add_one[(1,)](x, 16, BLOCK=16)
    add_one[(1,)](x, 16, BLOCK=16)  # the same variant: compiled once
    add_one[(1,)](x, 15, BLOCK=16)  # n no longer divisible by 16: Triton specialises a new variant
    torch.cuda.synchronize()
    watch.disarm()
    assert watch.count == 2 and watch.seconds > 0
    assert all("add_one" in r["kernel"] for r in watch.stats()["recent"])
    assert x[:15].tolist() == [3.0] * 15 and x[15].item() == 2.0
