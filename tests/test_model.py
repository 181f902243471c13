"""The model: shapes, the attention seam, RMSNorm and RoPE (exercises ch00.1, ch00.2), causality."""

import math

import pytest
import torch

from minivllm.model.transformer import (
    CausalAttention,
    ModelConfig,
    RMSNorm,
    RopeTable,
    Transformer,
    apply_rope,
    attention_reference,
    expand_kv_heads,
    init_weights,
    placed_on,
    rope_cos_sin,
)

SMALL = ModelConfig(d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=96, max_seq_len=64)


@pytest.fixture(scope="module")
def model() -> Transformer:
    m = Transformer(SMALL)
    init_weights(m, seed=0)
    return m.eval()


class RecordingAttention:
    """An attention object that records every call crossing the seam, then does causal attention."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple, tuple, tuple]] = []

    def __call__(self, layer, q, k, v):
        self.calls.append((layer, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return CausalAttention()(layer, q, k, v)


def test_config_rejects_inconsistent_heads():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(d_model=64, n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(d_model=60, n_heads=8, n_kv_heads=2)


def test_logits_shape_for_one_sequence_and_a_batch(model):
    ids = torch.randint(0, SMALL.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    assert model(ids).shape == (2, 5, SMALL.vocab_size)
    assert model(ids[0]).shape == (5, SMALL.vocab_size)
    torch.testing.assert_close(model(ids)[1], model(ids[1]), atol=1e-5, rtol=1e-5)


def test_seam_receives_rotated_qkv_for_every_layer_in_order(model):
    seam = RecordingAttention()
    model(torch.arange(7), attention=seam)
    hd = SMALL.head_dim
    assert seam.calls == [
        (layer, (7, 8, hd), (7, 2, hd), (7, 2, hd)) for layer in range(SMALL.n_layers)
    ]


def test_default_attention_equals_the_written_out_reference(model):
    """CausalAttention (fused SDPA with GQA) against plain softmax attention with a causal mask."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(6, 8, 16, generator=g),
        torch.randn(6, 2, 16, generator=g),
        torch.randn(6, 2, 16, generator=g),
    )
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(
        CausalAttention()(0, q, k, v), attention_reference(q, k, v, mask), atol=1e-5, rtol=1e-5
    )


def test_grouped_query_heads_share_kv_heads_in_blocks():
    kv = torch.arange(2 * 3).reshape(1, 2, 3).float()  # one position, 2 kv heads
    expanded = expand_kv_heads(kv, group_size=4)
    assert [int(expanded[0, h, 0]) for h in range(8)] == [0, 0, 0, 0, 3, 3, 3, 3]


def test_future_tokens_do_not_change_past_logits(model):
    ids = torch.tensor([256, 72, 101, 108, 108, 111])
    torch.testing.assert_close(model(ids[:4]), model(ids)[:4], atol=1e-5, rtol=1e-5)


def test_the_last_layer_goes_on_past_its_attention_with_the_wanted_rows_only(model):
    """With `rows`, the logits are those rows' of the whole pass; every row still reaches the last
    layer's attention (its keys and values are cached), and only `rows` its MLP."""
    ids = torch.tensor([[256, 72, 101, 108, 108, 111, 44, 32], [256, 65, 66, 67, 68, 69, 70, 71]])
    rows = torch.tensor([2, 7])
    seam, mlp_rows = RecordingAttention(), []
    hook = model.model.layers[-1].mlp.register_forward_pre_hook(
        lambda module, args: mlp_rows.append(args[0].shape[-2])
    )
    try:
        picked = model(ids, attention=seam, rows=rows)
    finally:
        hook.remove()
    torch.testing.assert_close(picked, model(ids)[:, rows], atol=1e-5, rtol=1e-5)
    assert [call[1][-3] for call in seam.calls] == [8] * SMALL.n_layers
    assert mlp_rows == [len(rows)]


def test_positions_argument_matches_the_default(model):
    ids = torch.tensor([256, 65, 66, 67])
    torch.testing.assert_close(model(ids, positions=torch.arange(4)), model(ids))


@pytest.mark.exercise("ch00.1")
def test_rmsnorm_matches_its_definition():
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(3)) * 5
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)


@pytest.mark.exercise("ch00.1")
def test_rmsnorm_output_has_unit_rms_and_ignores_scale():
    norm = RMSNorm(16, eps=1e-6)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    out = norm(x)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(4), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(norm(1000 * x), out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [4, 6, 16, 64, 128])
def test_rope_cos_sin_reads_the_computed_values_from_its_table(head_dim: int, monkeypatch) -> None:
    """On the CPU `rope_cos_sin` reads a `RopeTable`: every shape of positions gets, bit for bit,
    the values computed for it alone -- a batch of one row, of odd sizes, a [B, T] grid -- and a
    position past the table grows it (by doubling) to the same values. Inside a compiled graph
    (and on a GPU, `serves`) the values are computed, not read."""
    import minivllm.model.transformer as transformer

    computed = transformer._rope_cos_sin
    monkeypatch.setattr(transformer, "_ROPE_TABLES", {})
    generator = torch.Generator().manual_seed(head_dim)
    shapes = [(1,), (3,), (17,), (64,), (2, 5), (300,)]
    for shape in shapes:
        positions = torch.randint(0, 200, shape, generator=generator)
        for read, direct in zip(
            rope_cos_sin(positions, head_dim, 1e4), computed(positions, head_dim, 1e4)
        ):
            assert read.shape == (*shape, head_dim) and torch.equal(read, direct)
    (table,) = transformer._ROPE_TABLES.values()
    assert table.rows[0].shape == (256, head_dim)
    far = torch.tensor([5, 4000, 70])
    assert torch.equal(rope_cos_sin(far, head_dim, 1e4)[1], computed(far, head_dim, 1e4)[1])
    assert table.rows[0].shape == (4096, head_dim)
    assert RopeTable.serves(far) and not RopeTable.serves(far[:0])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not RopeTable.serves(far)


@pytest.mark.exercise("ch00.2")
def test_rope_at_position_zero_is_the_identity():
    x = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(5))
    cos, sin = rope_cos_sin(torch.zeros(1, dtype=torch.long), 16, 10000.0)
    torch.testing.assert_close(apply_rope(x, cos, sin), x)


@pytest.mark.exercise("ch00.2")
def test_rope_rotates_pairs_i_and_i_plus_half():
    """Position 1, head_dim 4: pair (0, 2) turns by 1 radian, pair (1, 3) by 1/100 radian."""
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    cos, sin = rope_cos_sin(torch.tensor([1]), 4, 10000.0)
    out = apply_rope(x, cos, sin)[0, 0]
    a, b = 1.0, 0.01
    expected = torch.tensor(
        [
            1 * math.cos(a) - 3 * math.sin(a),
            2 * math.cos(b) - 4 * math.sin(b),
            3 * math.cos(a) + 1 * math.sin(a),
            4 * math.cos(b) + 2 * math.sin(b),
        ]
    )
    torch.testing.assert_close(out, expected)


@pytest.mark.exercise("ch00.2")
def test_rope_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)

    def score(pos_q: int, pos_k: int) -> torch.Tensor:
        cq, sq = rope_cos_sin(torch.tensor([pos_q]), 32, 10000.0)
        ck, sk = rope_cos_sin(torch.tensor([pos_k]), 32, 10000.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(7, 3), score(7, 5), atol=1e-3)
    # a rotation keeps the length of every vector
    cos, sin = rope_cos_sin(torch.tensor([37]), 32, 10000.0)
    torch.testing.assert_close(apply_rope(q, cos, sin).norm(), q.norm())


def test_parameter_count_matches_the_formula():
    c = SMALL
    attention = c.d_model * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    per_layer = attention + 3 * c.d_model * c.d_ff + 2 * c.d_model
    expected = 2 * c.vocab_size * c.d_model + c.n_layers * per_layer + c.d_model
    assert Transformer(c).num_parameters() == expected


def test_init_is_a_function_of_the_seed():
    a, b, c = Transformer(SMALL), Transformer(SMALL), Transformer(SMALL)
    init_weights(a, 7), init_weights(b, 7), init_weights(c, 8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_forward_makes_no_tensor_off_the_models_device(model):
    """On the meta device every op checks that its inputs share a device, so a tensor made on the
    CPU inside the forward (a rope table, default positions) raises here -- the class of bug that
    breaks every request on a GPU, caught on a CPU-only machine."""
    meta = placed_on(model, "meta")
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    assert meta(ids).shape == (2, 5, SMALL.vocab_size)
    positions = torch.arange(5, device="meta").expand(2, 5)
    assert meta(ids, positions).device.type == "meta"
    cos, sin = rope_cos_sin(positions, SMALL.head_dim, SMALL.rope_theta)
    assert cos.device.type == sin.device.type == "meta"


def test_placing_a_model_on_another_device_leaves_the_callers_where_it_was(model):
    moved = placed_on(model, "meta")
    assert moved is not model and next(moved.parameters()).device.type == "meta"
    assert next(model.parameters()).device.type == "cpu"  # the caller's model did not move
    assert placed_on(model, "cpu") is model  # already there: no copy
    assert not placed_on(model, "cpu").training
