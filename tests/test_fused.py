"""Fused projections (model/fused.py): one matmul for q, k, v and one for gate, up give the unfused
model's logits bit for bit; the caller's model keeps its own projections; the engine runs the fused
copy and gives the same greedy tokens either way; a model the engine loads itself is fused in
place, so its weights live once."""

from __future__ import annotations

import copy
import gc
import weakref

import numba
import pytest
import torch
import torch.nn.functional as F

import minivllm.engine.llm_engine as llm_engine
import minivllm.model.fused as fused_module
from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.model import cpu_kernels
from minivllm.model.derived import DerivedCache
from minivllm.model.families import HFRMSNorm
from minivllm.model.fused import (
    FusedHFRMSNorm,
    FusedSelfAttention,
    FusedSwiGLU,
    fuse_projections,
    is_fused,
    on_cpu_in_float32,
)
from minivllm.model.transformer import apply_rope, rope_cos_sin
from minivllm.training.corpus import shipped_validation_text


@pytest.fixture(scope="module")
def fused(target):
    return fuse_projections(target)


@pytest.mark.parametrize("shape", [(1,), (7,), (64,), (300,), (4, 33)])
def test_fused_logits_are_the_unfused_ones_bit_for_bit(target, fused, shape) -> None:
    ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(len(shape)))
    with torch.no_grad():
        assert torch.equal(fused(ids), target(ids))


def test_the_fused_models_logits_of_some_rows_are_the_unfused_ones_bit_for_bit(target, fused):
    """`rows` takes the last layer's output projection and MLP over those rows only, in the fused
    model as in the book's: bit for bit the book model's logits with the same `rows`, and the whole
    pass's at those rows to float32 rounding (its matmuls then run at other row counts)."""
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(5))
    rows = torch.tensor([0, 151, 299])
    with torch.no_grad():
        picked = fused(ids, rows=rows)
        assert torch.equal(picked, target(ids, rows=rows))
        torch.testing.assert_close(picked, target(ids)[rows], atol=1e-5, rtol=1e-5)


def test_where_autograd_records_the_fused_model_keeps_to_out_of_place_ops(fused) -> None:
    """The fused model adds residuals and applies SiLU in place only where nothing records a
    backward (an engine's inference): with autograd on, its forward is differentiable."""
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.enable_grad():
        logits = fused(ids)
        assert logits.requires_grad
        logits.square().mean().backward()  # an in-place op on a saved tensor would raise here
    head = fused.lm_head.weight
    assert head.grad is not None and bool(head.grad.abs().sum() > 0)
    fused.zero_grad(set_to_none=True)


def test_every_layer_is_fused_and_the_callers_model_is_untouched(target, fused) -> None:
    for original, layer in zip(target.model.layers, fused.model.layers):
        assert isinstance(layer.self_attn, FusedSelfAttention)
        assert isinstance(layer.mlp, FusedSwiGLU)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
        assert type(original.self_attn).__name__ == "SelfAttention"
        q, k, v = (original.self_attn.q_proj, original.self_attn.k_proj, original.self_attn.v_proj)
        assert torch.equal(layer.self_attn.qkv_weight, torch.cat([q.weight, k.weight, v.weight]))
    assert not any(True for _ in target.buffers())  # nothing was added to the caller's model


def test_the_engine_runs_the_fused_copy_with_the_same_greedy_tokens(target) -> None:
    text = shipped_validation_text()
    prompts = [text[500 * i : 500 * i + 20 + 9 * i] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0)
    tokens = {}
    for fuse in (False, True):
        engine = LLMEngine(target, EngineConfig(num_blocks=64, fuse_projections=fuse))
        layer = engine.runner.model.model.layers[0]
        assert isinstance(layer.self_attn, FusedSelfAttention) == fuse
        tokens[fuse] = [o.token_ids for o in engine.generate(prompts, params)]
    assert tokens[True] == tokens[False]
    assert not is_fused(target) and hasattr(target.model.layers[0].self_attn, "q_proj")


def distinct_bytes(*models) -> int:
    """Bytes of the distinct tensor storages the models' parameters and buffers use."""
    tensors = [t for m in models for t in (*m.parameters(), *m.buffers())]
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def test_an_engine_that_loads_its_model_fuses_it_in_place(target, monkeypatch) -> None:
    """`LLM(folder)` loads the model for its engine alone: the engine fuses that model itself, the
    separate projections are freed, and the engine keeps one model's bytes -- not the loaded
    model beside a fused copy."""
    loaded, load_model = [], llm_engine.load_model

    def load_and_watch(*args, **kwargs):
        model = load_model(*args, **kwargs)
        loaded.append(weakref.ref(model.model.layers[0].self_attn.q_proj.weight))
        return model

    monkeypatch.setattr(llm_engine, "load_model", load_and_watch)
    engine = LLM("target", num_blocks=16).engine
    gc.collect()
    assert engine.model is engine.runner.model and is_fused(engine.model)
    assert loaded[0]() is None  # the loaded q_proj is gone: nothing kept the unfused model
    one_model = sum(p.numel() * p.element_size() for p in target.parameters())
    assert distinct_bytes(engine.model, engine.runner.model) == one_model
    # the engine's own model handed to another engine is run as it is, not fused again or copied
    again = LLMEngine(engine.model, EngineConfig(num_blocks=16))
    assert again.runner.model is engine.model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 32), (4, 4, 64), (16, 8, 128), (2, 1, 6)])
@pytest.mark.parametrize("rows", [1, 5, 130])
def test_the_cpu_rope_kernel_is_apply_rope_bit_for_bit(heads, kv_heads, dim, rows, dtype) -> None:
    """`cpu_kernels.rope_qk` (and `rope_qk_bfloat16`, which rounds where torch's bfloat16 ops
    round) on views into a q|k|v matmul's output (the fused model's), on contiguous tensors
    (after Qwen3's q/k norms) and on heads laid out head-major (not side by side in a token: the
    loops copy those first), at any position: apply_rope's values exactly, new contiguous tensors,
    the inputs untouched."""
    rope = cpu_kernels.rope_qk if dtype == torch.float32 else cpu_kernels.rope_qk_bfloat16
    generator = torch.Generator().manual_seed(rows * dim)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator) * 4).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)
    positions = torch.randint(0, 100_000, (rows,), generator=generator)
    cos, sin = (t.to(dtype) for t in rope_cos_sin(positions, dim, 1_000_000.0))
    before = qkv.clone()
    head_major = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k)]
    for q_in, k_in in [(q, k), (q.contiguous(), k.contiguous()), head_major]:
        q_out, k_out = rope(q_in, k_in, cos, sin)
        assert torch.equal(q_out, apply_rope(q_in, cos, sin))
        assert torch.equal(k_out, apply_rope(k_in, cos, sin))
        assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 32), (16, 8, 128), (2, 1, 6)])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_cpu_norm_kernel_is_rms_norm_to_float32_rounding(heads, kv_heads, dim, rows) -> None:
    """`cpu_kernels.rms_norm` on a hidden state, on Qwen3's q and k (views into the q|k|v matmul's
    output) and on a contiguous copy: torch's rms_norm to float32 rounding, a new contiguous
    tensor, the input untouched."""
    generator = torch.Generator().manual_seed(rows + dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator) * 3
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    before = qkv.clone()
    for x in (qkv, q.view(rows, heads, dim), k.view(rows, kv_heads, dim), q.contiguous()):
        weight = torch.rand(x.shape[-1], generator=generator) + 0.5
        out = cpu_kernels.rms_norm(x, weight, 1e-6)
        expected = F.rms_norm(x, weight.shape, weight, 1e-6)
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
        assert out.shape == x.shape and out.is_contiguous()
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("heads, kv_heads, dim", [(16, 8, 128), (2, 1, 6)])
@pytest.mark.parametrize("rows", [1, 300])
def test_the_bfloat16_norm_loop_rounds_where_hf_rms_norm_rounds(heads, kv_heads, dim, rows) -> None:
    """`cpu_kernels.hf_rms_norm_bfloat16` on a hidden state and on Qwen3's q and k (views into the
    q|k|v matmul's output): `HFRMSNorm` in bfloat16 -- every element equal, or one bfloat16
    rounding away where the sum of squares, added in another order, moved the scale -- a new
    contiguous tensor, the input untouched. A NaN stays a NaN. The fused model's norm takes the
    loop with `compiled_loop` (a model whose weights were packed). A scale one rounding away can
    put the output two bfloat16 steps away: both round the normalised value to bfloat16 and then
    its product with the weight, and the second rounding can double the first's step (seen on
    an Intel host with AMX and 16 threads: 7 of 1.2 M elements)."""
    generator = torch.Generator().manual_seed(rows + dim)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator) * 3).bfloat16()
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    before = qkv.clone()
    for x in (qkv, q.view(rows, heads, dim), k.view(rows, kv_heads, dim)):
        norm = FusedHFRMSNorm(x.shape[-1], 1e-6).bfloat16()
        norm.weight.data = (torch.rand(x.shape[-1], generator=generator) + 0.5).bfloat16()
        expected = HFRMSNorm.forward(norm, x)
        out = cpu_kernels.hf_rms_norm_bfloat16(x, norm.weight, 1e-6)
        assert out.shape == x.shape and out.is_contiguous() and out.dtype == torch.bfloat16
        assert (out == expected).float().mean() >= 0.999
        torch.testing.assert_close(out, expected, rtol=2**-6, atol=0)
        norm.compiled_loop = True
        assert torch.equal(norm(x), out)
    assert torch.equal(qkv, before)
    poisoned = qkv.clone()
    poisoned[0, 0] = float("nan")
    weight = torch.ones(qkv.shape[-1], dtype=torch.bfloat16)
    assert cpu_kernels.hf_rms_norm_bfloat16(poisoned, weight, 1e-6)[0].isnan().all()


@pytest.mark.parametrize("heads, kv_heads, dim", [(16, 8, 128), (2, 1, 6)])
@pytest.mark.parametrize("rows", [1, 300])
def test_qwen3s_norms_and_rope_as_one_call_give_the_three_calls_bits(heads, kv_heads, dim, rows):
    """`cpu_kernels.qk_norm_rope_bfloat16` -- Qwen3's q and k norms, then RoPE, one head's row at
    a time in one call -- on views into a q|k|v matmul's output: the bits of the norms' loop
    (`hf_rms_norm_bfloat16`) and then the rotation's (`rope_qk_bfloat16`), new contiguous
    tensors, the input untouched."""
    generator = torch.Generator().manual_seed(rows * dim)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator) * 3).bfloat16()
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)
    norms = [FusedHFRMSNorm(dim, eps).bfloat16() for eps in (1e-6, 1e-5)]
    for norm in norms:
        norm.weight.data = (torch.rand(dim, generator=generator) + 0.5).bfloat16()
    positions = torch.randint(0, 100_000, (rows,), generator=generator)
    cos, sin = (t.bfloat16() for t in rope_cos_sin(positions, dim, 1_000_000.0))
    before = qkv.clone()
    q_out, k_out = cpu_kernels.qk_norm_rope_bfloat16(q, k, *norms, cos, sin)
    normed = (cpu_kernels.hf_rms_norm_bfloat16(x, n.weight, n.eps) for x, n in zip((q, k), norms))
    q_expected, k_expected = cpu_kernels.rope_qk_bfloat16(*normed, cos, sin)
    assert torch.equal(q_out, q_expected) and torch.equal(k_out, k_expected)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(qkv, before)


@pytest.mark.skipif(
    min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS) < 2,
    reason="the parallel loop needs two threads, of torch's and of numba's",
)
def test_a_prefill_chunks_q_k_norms_and_rope_run_on_numbas_threads_with_the_same_bits(monkeypatch):
    """`qk_norm_rope_bfloat16` on PARALLEL_MIN_TOKENS tokens or more runs its tokens in shares on
    numba's threads (`_qk_norm_rope_bfloat16_shared`), with the one-thread loop's bits; fewer
    tokens (a decode step's) stay on the calling thread."""
    rows, heads, kv_heads, dim = 2 * cpu_kernels.PARALLEL_MIN_TOKENS + 3, 4, 2, 64
    generator = torch.Generator().manual_seed(7)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator) * 3).bfloat16()
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)
    norms = [FusedHFRMSNorm(dim, 1e-6).bfloat16() for _ in range(2)]
    cos, sin = (t.bfloat16() for t in rope_cos_sin(torch.arange(rows) * 7, dim, 10_000.0))
    shared, launches = cpu_kernels._qk_norm_rope_bfloat16_shared, []

    def counted(bounds, *args):
        launches.append(bounds.tolist())
        return shared(bounds, *args)

    monkeypatch.setattr(cpu_kernels, "_qk_norm_rope_bfloat16_shared", counted)
    parallel = cpu_kernels.qk_norm_rope_bfloat16(q, k, *norms, cos, sin)
    assert len(launches) == 1 and launches[0][0] == 0 and launches[0][-1] == rows
    assert len(launches[0]) == min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS) + 1
    monkeypatch.setattr(cpu_kernels, "PARALLEL_MIN_TOKENS", rows + 1)
    alone = cpu_kernels.qk_norm_rope_bfloat16(q, k, *norms, cos, sin)
    assert len(launches) == 1  # fewer tokens than the threshold: the calling thread's loop
    assert all(torch.equal(a, b) for a, b in zip(parallel, alone))


def test_the_bfloat16_loops_read_a_weight_changed_in_place_anew() -> None:
    """The bfloat16 loops keep a weight's (and a step's cos and sin) bits from call to call
    (`cpu_kernels._held`): a weight changed in place is read again -- also one not contiguous,
    whose held bits are a copy -- and the entry goes with the weight."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(3, 16, generator=generator).bfloat16()
    # every other element of a longer one: not contiguous, so the loops hold a copy of its bits
    weight = (torch.rand(32, generator=generator) + 0.5).bfloat16()[::2]
    first = cpu_kernels.hf_rms_norm_bfloat16(x, weight, 1e-6)
    assert cpu_kernels._HELD.holds(weight)
    weight.mul_(2)
    changed = cpu_kernels.hf_rms_norm_bfloat16(x, weight, 1e-6)
    assert torch.equal(changed, cpu_kernels.hf_rms_norm_bfloat16(x, weight.clone(), 1e-6))
    assert not torch.equal(changed, first)
    key = id(weight)
    del weight
    gc.collect()
    assert key not in cpu_kernels._HELD._entries


def test_a_derived_cache_makes_again_only_for_a_changed_or_another_tensor() -> None:
    """`DerivedCache` (the packed weights', the loops' arrays): made once per tensor, again after an
    in-place change; an inference tensor, which has no version, is trusted as it was made; an
    entry goes with its tensor, and a new tensor at a freed one's address gets its own."""
    cache: DerivedCache[int] = DerivedCache()
    made = iter(range(100))

    def make(_tensor: torch.Tensor) -> int:
        return next(made)

    weight = torch.zeros(4)
    assert cache.get(weight, make) == 0 and cache.get(weight, make) == 0
    weight.add_(1)
    assert cache.get(weight, make) == 1 and cache.holds(weight)
    with torch.inference_mode():
        step = torch.zeros(4)
    assert cache.get(step, make) == 2 and cache.get(step, make) == 2
    assert sorted(cache.values()) == [1, 2]
    del weight, step
    gc.collect()
    assert len(cache) == 0
    for _ in range(20):  # freed tensors' ids are reused: each new tensor gets its own entry
        before = next(made)
        assert cache.get(torch.zeros(4), make) == before + 1
    assert not cache.holds(torch.zeros(4))


def test_the_cpu_kernels_take_float32_cpu_tensors_only() -> None:
    x = torch.zeros(2, 2)
    assert on_cpu_in_float32(x, x)
    assert not on_cpu_in_float32(x, x.to(torch.bfloat16))
    assert not on_cpu_in_float32(x.to(torch.float64))


def test_a_big_weight_goes_through_onednn_packed_once(monkeypatch) -> None:
    """`linear` packs a float32 weight of PACK_MIN_BYTES or more once, reuses the packing, packs
    again after an in-place change, forgets it with the weight, and matches F.linear to float32
    rounding; a smaller weight takes F.linear itself, and a bfloat16 one gives F.linear's bits
    (packed only where the CPU multiplies bfloat16: the next test)."""
    if not fused_module.ONEDNN_LINEAR:
        pytest.skip("this torch has no oneDNN linear ops")
    generator = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(1024, 1024, generator=generator))  # 4 MiB
    x = torch.randn(8, 1024, generator=generator)
    with torch.inference_mode():
        packed = fused_module.linear(x, weight)
        assert fused_module._PACKED.holds(weight)
        torch.testing.assert_close(packed, F.linear(x, weight), rtol=1e-5, atol=1e-4)
        entry = fused_module._packed(weight)
        fused_module.linear(x, weight)
        assert fused_module._packed(weight) is entry  # packed once
    with torch.no_grad():
        weight.mul_(2)
        torch.testing.assert_close(fused_module.linear(x, weight), 2 * packed, rtol=1e-5, atol=1e-3)
    key = id(weight)
    del weight, entry
    gc.collect()
    assert key not in fused_module._PACKED._entries
    small = torch.randn(16, 1024, generator=generator)
    assert torch.equal(fused_module.linear(x, small), F.linear(x, small))
    monkeypatch.setattr(fused_module, "PACK_MIN_BYTES", 0)
    half = small.to(torch.bfloat16)
    assert torch.equal(
        fused_module.linear(x.to(torch.bfloat16), half), F.linear(x.bfloat16(), half)
    )


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_a_big_bfloat16_weight_packs_where_the_cpu_multiplies_bfloat16(
    rows: int, monkeypatch
) -> None:
    """Where oneDNN has a bfloat16 path on this CPU (AVX-512 BF16, AMX), a bfloat16 weight of
    PACK_MIN_BYTES or more is taken through the packed matmul, with a bias too (Qwen2's q|k|v),
    and gives F.linear's values to within one bfloat16 rounding: both sum in float32, in orders
    that can differ (bit for bit on an AMD Zen 4; an Intel host with AMX differed at 300 rows).
    Elsewhere nothing bfloat16 packs, and F.linear runs."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(2048, 1024, generator=generator).to(torch.bfloat16)  # 4 MiB
    bias = torch.randn(2048, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, 1024, generator=generator).to(torch.bfloat16)
    assert fused_module.packs(weight) == fused_module.ONEDNN_BFLOAT16
    assert not fused_module.packs(weight[:1000])  # under PACK_MIN_BYTES in bfloat16's bytes
    packed_calls = count_packed_calls(monkeypatch)
    with torch.inference_mode():
        for b in (None, bias):
            out = fused_module.linear(x, weight, b)
            torch.testing.assert_close(out, F.linear(x, weight, b), rtol=2**-7, atol=2**-8)
        assert len(packed_calls) == (2 if fused_module.ONEDNN_BFLOAT16 else 0)
        # a float32 input against a bfloat16 weight is F.linear's to decide (it refuses)
        with pytest.raises(RuntimeError):
            fused_module.linear(x.float(), weight)
    assert fused_module._PACKED.holds(weight) == fused_module.ONEDNN_BFLOAT16
    if not fused_module.ONEDNN_BFLOAT16:
        pytest.skip("bfloat16 packing not checked: oneDNN has no bfloat16 path on this CPU")


def record_packed_rows(monkeypatch) -> list[int]:
    """A list that grows by the rows of each packed matmul oneDNN runs from now on
    (`torch.ops.mkldnn._linear_pointwise` as `fused` calls it), which still runs."""
    rows_multiplied = []
    mkldnn = torch.ops.mkldnn
    onednn = mkldnn._linear_pointwise

    class Recording:  # torch.ops.mkldnn, recording the rows each packed matmul got
        def _linear_pointwise(self, x, *args):
            rows_multiplied.append(x.shape[0])
            return onednn(x, *args)

        def __getattr__(self, name):
            return getattr(mkldnn, name)

    monkeypatch.setattr(fused_module.torch.ops, "mkldnn", Recording())
    return rows_multiplied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_big_weight_takes_a_few_rows_padded_to_four(dtype: torch.dtype, monkeypatch) -> None:
    """`linear` multiplies a big packed weight by fewer than PADDED_MIN_ROWS rows as that many
    (oneDNN's kernel for four streams it faster; one row pads in float32 only), and returns the
    rows asked for, in the input's shape, equal to the unpadded call's to rounding (four rows sum
    in another order in float32; in bfloat16 the bits matched on an AMD Zen 4, but an Intel host
    with AMX may sum otherwise). Four rows go as they are."""
    if dtype not in fused_module.PACKED_DTYPES or not fused_module.ONEDNN_LINEAR:
        pytest.skip(f"oneDNN packs no {dtype} weight on this CPU")
    generator = torch.Generator().manual_seed(5)
    # 4 MiB in bfloat16, 8 in float32: PACK_MIN_BYTES or more
    weight = (torch.randn(2048, 1024, generator=generator) * 0.05).to(dtype)
    x = torch.randn(1, 3, 1024, generator=generator).to(dtype)  # [batch, tokens, features]
    onednn = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        unpadded = {
            n: onednn(x[0, :n], fused_module._packed(weight), None, "none", [], "")
            for n in (1, 2, 3)
        }
        rows_multiplied = record_packed_rows(monkeypatch)
        for n in (1, 2, 3):
            out = fused_module.linear(x[:, :n], weight)
            assert out.shape == (1, n, weight.shape[0]) and out.is_contiguous()
            tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(out[0], unpadded[n], rtol=tolerance, atol=tolerance)
        four = fused_module.linear(x.expand(2, 3, 1024).reshape(6, 1024)[:4], weight)
    one_row = 1 if dtype == torch.bfloat16 else 4
    assert rows_multiplied == [one_row, 4, 4, 4]
    three = fused_module.linear(x[0], weight)
    torch.testing.assert_close(four[:3], three, rtol=2**-7, atol=2**-7)


def test_matmul_rows_are_a_few_sizes_a_doubling_at_most_an_eighth_more() -> None:
    """`matmul_rows`: a decode's rows as they are, up to EXACT_ROWS; above, one of
    SIZES_PER_DOUBLING sizes between each power of two and the next, never fewer rows than asked
    and at most an eighth more -- so a token budget of 512 rows makes 24 sizes above 64, not 448."""
    rows = fused_module.matmul_rows
    asked = (1, 63, 64, 65, 72, 73, 128, 129, 300, 512, 513)
    assert [rows(n) for n in asked] == [1, 63, 64, 72, 72, 80, 128, 144, 320, 512, 576]
    for n in range(1, 2049):
        assert n <= rows(n) <= n + max(0, n - 1) // 8 and rows(rows(n)) == rows(n)
    assert len({rows(n) for n in range(65, 513)}) == 3 * fused_module.SIZES_PER_DOUBLING


def test_a_packed_matmul_of_many_rows_reads_on_into_padded_memory(monkeypatch) -> None:
    """Above EXACT_ROWS rows a packed matmul runs at `matmul_rows` rows where its input's memory
    runs on that far (`row_padded`, as the engine's norms and SwiGLU write), and at its own rows
    where it does not (a copy, here): the rows asked for come back, in a tensor of their own
    shape, equal to the exact call's to float32 rounding."""
    if not fused_module.ONEDNN_LINEAR:
        pytest.skip("this torch has no oneDNN linear ops")
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(2048, 1024, generator=generator) * 0.05  # 8 MiB: PACK_MIN_BYTES or more
    x = fused_module.row_padded(300, 1024, weight)
    assert x.shape == (300, 1024) and x.untyped_storage().nbytes() == 320 * 1024 * 4
    assert torch.equal(x.as_strided((320, 1024), (1024, 1))[300:], torch.zeros(20, 1024))
    x.copy_(torch.randn(300, 1024, generator=generator))
    onednn = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        exact = onednn(x.clone(), fused_module._packed(weight), None, "none", [], "")
        rows_multiplied = record_packed_rows(monkeypatch)
        padded = fused_module.linear(x, weight)
        unpadded = fused_module.linear(x.clone(), weight)
    assert rows_multiplied == [320, 300]
    for out in (padded, unpadded):
        assert out.shape == (300, 2048) and out.is_contiguous()
        torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)


def test_the_engines_norms_write_where_the_next_matmul_reads_on() -> None:
    """A packed model's norm of an engine's rows (`[tokens, hidden]`) writes into memory that runs
    on to `matmul_rows` rows (`row_padded`), its values the same as into a tensor of its own; a
    row count that is its own size, or another shape, gets a tensor of its own."""
    norm = fused_module.FusedRMSNorm(256, 1e-5)
    norm.compiled_loop = True
    x = torch.randn(100, 256, generator=torch.Generator().manual_seed(3))
    out = norm(x)
    assert out.untyped_storage().nbytes() == fused_module.matmul_rows(100) * 256 * 4 > x.nbytes
    torch.testing.assert_close(out, cpu_kernels.rms_norm(x, norm.weight, norm.eps), rtol=0, atol=0)
    assert norm(x[:64]).untyped_storage().nbytes() == 64 * 256 * 4
    assert norm(x.view(4, 25, 256)).untyped_storage().nbytes() == x.nbytes


def count_packed_calls(monkeypatch) -> list:
    """A list that grows by one at each call of `fused._packed_linear` (eager `linear`'s packed
    path), which still runs."""
    calls = []
    packed_linear = fused_module._packed_linear

    def counted(*args):
        calls.append(args[1].shape)
        return packed_linear(*args)

    monkeypatch.setattr(fused_module, "_packed_linear", counted)
    return calls


NOTHING_PACKED = 1 << 62  # a packing threshold no weight reaches


def cpu_config(num_blocks: int) -> EngineConfig:
    """An engine on the CPU whatever the machine has: packing is a CPU path, and on a GPU machine
    `device='auto'` would put the weights where nothing is packed."""
    return EngineConfig(num_blocks=num_blocks, device="cpu")


def packable_weights(model) -> list[torch.Tensor]:
    """The fused model's weights that `linear` multiplies: every one but the embedding's."""
    return [model.lm_head.weight] + [
        w
        for layer in model.model.layers
        for w in (
            layer.self_attn.qkv_weight,
            layer.self_attn.o_proj.weight,
            layer.mlp.gate_up_weight,
            layer.mlp.down_proj.weight,
        )
    ]


def norms(model) -> list[fused_module.FusedRMSNorm]:
    found = [m for m in model.modules() if isinstance(m, fused_module.FusedRMSNorm)]
    assert len(found) == 2 * len(model.model.layers) + 1
    return found


def test_the_engine_packs_its_big_weights_as_it_starts(target, monkeypatch) -> None:
    """Every weight `linear` would pack is packed while the engine is built (`pack_weights`), so
    no request's step packs one: a real model's first step would otherwise pay seconds for it.
    The book's are all under PACK_MIN_BYTES: its three of PACK_BATCHED_MIN_BYTES or more a layer
    (q|k|v, gate|up, down) are packed, the o-projection and the LM head are not."""
    if not fused_module.ONEDNN_LINEAR:
        pytest.skip("this torch has no oneDNN linear ops")
    book = LLMEngine(target, cpu_config(num_blocks=16)).runner.model
    layers = book.model.layers
    batched = [
        w
        for layer in layers
        for w in (layer.self_attn.qkv_weight, layer.mlp.gate_up_weight, layer.mlp.down_proj.weight)
    ]
    assert fused_module.pack_weights(book) == sum(w.numel() * 4 for w in batched)
    assert all(fused_module._is_packed(w) for w in batched)
    unpacked = [book.lm_head.weight] + [layer.self_attn.o_proj.weight for layer in layers]
    assert not any(fused_module._is_packed(w) for w in unpacked)
    assert all(norm.compiled_loop for norm in norms(book))  # equal to rounding already
    monkeypatch.setattr(fused_module, "PACK_MIN_BYTES", 0)
    engine = LLMEngine(target, cpu_config(num_blocks=64))
    # packed logits are equal to rounding already: the norms take the compiled loop too
    assert all(norm.compiled_loop for norm in norms(engine.runner.model))
    weights = packable_weights(engine.runner.model)
    assert all(fused_module._PACKED.holds(w) for w in weights)
    packed = [fused_module._packed(w) for w in weights]
    engine.generate([shipped_validation_text()[:40]], SamplingParams(max_tokens=4, temperature=0))
    assert all(fused_module._packed(w) is p for w, p in zip(weights, packed))  # none packed again


def test_a_smaller_weight_is_packed_for_batches_only_where_the_engine_packed_it(
    target, monkeypatch
) -> None:
    """A weight under PACK_MIN_BYTES but of PACK_BATCHED_MIN_BYTES or more: a fused model no
    engine packed multiplies it with F.linear at any batch (chapter 07's keeps the unfused model's
    bits); once `pack_weights` packed it, a batch of PACKED_MIN_ROWS rows or more goes through the
    packed copy (equal to float32 rounding) and a single row still through F.linear, bit for bit.
    Even where the model is the caller's alone (`release`) its own copy stays, for that row."""
    if not fused_module.ONEDNN_LINEAR:
        pytest.skip("this torch has no oneDNN linear ops")
    model = fused_module.fuse_projections(target)
    weight = model.model.layers[0].mlp.gate_up_weight
    size = weight.numel() * weight.element_size()
    assert fused_module.PACK_BATCHED_MIN_BYTES <= size < fused_module.PACK_MIN_BYTES
    generator = torch.Generator().manual_seed(5)
    batch = torch.randn(16, weight.shape[1], generator=generator)
    with torch.inference_mode():
        assert not fused_module.packs(weight, rows=16)
        assert torch.equal(fused_module.linear(batch, weight), F.linear(batch, weight))
        assert not fused_module._is_packed(weight)  # nothing packed it on the way
        fused_module.pack_weights(model, release=True)
        assert not weight.is_meta and model.model.layers[0].mlp.gate_up_weight is weight
        assert fused_module.packs(weight, rows=16) and not fused_module.packs(weight, rows=1)
        # which path ran is counted, not read off the bits: on an Intel host (torch 2.11) the
        # unpacked and packed sums of a 16-row batch came out equal
        packed_calls = count_packed_calls(monkeypatch)
        packed = fused_module.linear(batch, weight)
        torch.testing.assert_close(packed, F.linear(batch, weight), rtol=1e-5, atol=1e-4)
        assert len(packed_calls) == 1, "the batch did not take the packed path"
        row = batch[:1]
        assert torch.equal(fused_module.linear(row, weight), F.linear(row, weight))
        assert len(packed_calls) == 1, "the single row took the packed path"
        # a [batch, seq, dim] input counts its rows across both leading dimensions
        assert fused_module.linear(batch.view(2, 8, -1), weight).shape == (2, 8, weight.shape[0])


def test_an_engine_on_packed_weights_gives_the_same_greedy_tokens(target, monkeypatch) -> None:
    """Every weight of the shipped model packed (the threshold at 0), and so its norms compiled
    loops: the engine's greedy tokens are the ones of F.linear's and torch's norm."""
    if not fused_module.ONEDNN_LINEAR:
        pytest.skip("this torch has no oneDNN linear ops")
    text = shipped_validation_text()
    prompts = [text[700 * i : 700 * i + 25 + 11 * i] for i in range(5)]
    params = SamplingParams(max_tokens=20, temperature=0)
    tokens = []
    for threshold in (NOTHING_PACKED, 0):
        monkeypatch.setattr(fused_module, "PACK_MIN_BYTES", threshold)
        monkeypatch.setattr(fused_module, "PACK_BATCHED_MIN_BYTES", threshold)
        engine = LLMEngine(target, cpu_config(num_blocks=64))
        tokens.append([o.token_ids for o in engine.generate(prompts, params)])
    assert tokens[0] == tokens[1]


def test_an_engine_keeps_only_the_packed_copy_of_a_model_it_alone_holds(target, monkeypatch):
    """The fused copy an engine runs is its alone: each packed weight's own copy is dropped (a
    meta tensor of its shape is left, which fails loudly when read), so the weights are not held
    twice; the caller's model keeps its own, a tied LM head stays for the embedding, and the
    tokens are those of an engine that packed nothing."""
    if not fused_module.ONEDNN_LINEAR:
        pytest.skip("this torch has no oneDNN linear ops")
    text = shipped_validation_text()
    prompts = [text[900 * i : 900 * i + 30 + 7 * i] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0)
    monkeypatch.setattr(fused_module, "PACK_BATCHED_MIN_BYTES", NOTHING_PACKED)
    unpacked = LLMEngine(target, cpu_config(num_blocks=64))
    assert unpacked.packed_weight_bytes == 0
    assert not any(w.is_meta for w in packable_weights(unpacked.runner.model))
    monkeypatch.setattr(fused_module, "PACK_MIN_BYTES", 0)
    engine = LLMEngine(target, cpu_config(num_blocks=64))
    assert engine.runner.model is not engine.model and engine.model is target
    assert all(w.is_meta for w in packable_weights(engine.runner.model))
    assert not any(p.is_meta for p in target.parameters())  # the caller's model is untouched
    assert engine.packed_weight_bytes >= sum(
        w.numel() * 4 for w in packable_weights(engine.runner.model)
    )
    with pytest.raises(NotImplementedError, match="meta"):
        engine.runner.model.model.layers[0].mlp.gate_up_weight.tolist()
    expected = [o.token_ids for o in unpacked.generate(prompts, params)]
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    # an engine handed that fused model (not its alone) packs nothing again and drops nothing
    again = LLMEngine(engine.runner.model, cpu_config(num_blocks=64))
    assert [o.token_ids for o in again.generate(prompts, params)] == expected

    tied = fused_module.fuse_model(copy.deepcopy(target))
    tied.lm_head.weight = tied.model.embed_tokens.weight
    kept = LLMEngine(tied, cpu_config(num_blocks=16))
    assert kept.runner.model is tied  # already fused: the caller's, so nothing is dropped
    assert not any(w.is_meta for w in packable_weights(tied))
    fused_module.pack_weights(tied, release=True)
    assert not tied.lm_head.weight.is_meta  # the embedding reads it
    assert all(w.is_meta for w in packable_weights(tied)[1:])
