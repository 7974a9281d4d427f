"""V1, V2 and DEX attention against references written here from DESIGN.md's formulas.

The references materialise every softmax map, apply RoPE with their own cos/sin, and share nothing with the
code under test except the module's weights. fp32, GQA (h_kv < h), tolerance 1e-5.
"""

import math

import pytest
import torch
from conftest import tiny_config

from modeling_diff.diff_attention import DexAttention, DiffAttentionV1, DiffAttentionV2, depth_lambda_init

B, L = 2, 9


def rope_tables(length: int, d: int, theta: float = 10000.0):
    """cos, sin of shape (B, L, d): frequency i pairs dims i and i + d/2 (the rotate-half convention)."""
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().expand(B, -1, -1), angles.sin().float().expand(B, -1, -1)


def rotate(x, cos, sin):
    """RoPE on the last dim of x (B, L, ..., d), written as a rotation of the pairs (x_i, x_{i+d/2})."""
    d = x.shape[-1]
    shape = (B, x.shape[1]) + (1,) * (x.dim() - 3) + (d,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    c, s = cos[..., : d // 2], sin[..., : d // 2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def causal_padding_mask(pad_left: list[int]):
    """Additive mask (B, 1, L, L): causal, and the first pad_left[b] keys of row b masked (left padding)."""
    allowed = torch.tril(torch.ones(L, L, dtype=torch.bool)).expand(B, L, L).clone()
    for b, pad in enumerate(pad_left):
        allowed[b, :, :pad] = False
        allowed[b, :pad, :] = torch.eye(L, dtype=torch.bool)[:pad]  # padded queries see themselves only
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]


def softmax_map(q, k, mask, scale):
    """q (B, L, d) one head, k (B, S, d): softmax(q k^T * scale + mask) of shape (B, L, S)."""
    return torch.softmax(q @ k.transpose(-1, -2) * scale + mask[:, 0], dim=-1)


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_v1(attn: DiffAttentionV1, x, cos, sin, mask):
    cfg, d = attn.config, attn.head_dim
    h, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    q = rotate((x @ attn.q_proj.weight.T).view(B, L, h, 2, d), cos, sin)
    k = rotate((x @ attn.k_proj.weight.T).view(B, L, h_kv, 2, d), cos, sin)
    v = (x @ attn.v_proj.weight.T).view(B, L, h_kv, 2 * d)
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * attn.layer_idx)
    lam = (
        torch.exp((attn.diff_lambda.lambda_q1 * attn.diff_lambda.lambda_k1).sum())
        - torch.exp((attn.diff_lambda.lambda_q2 * attn.diff_lambda.lambda_k2).sum())
        + lambda_init
    )
    heads, maps = [], []
    for i in range(h):
        kv = i // (h // h_kv)
        a1 = softmax_map(q[:, :, i, 0], k[:, :, kv, 0], mask, d**-0.5)
        a2 = softmax_map(q[:, :, i, 1], k[:, :, kv, 1], mask, d**-0.5)
        heads.append(rms((a1 - lam * a2) @ v[:, :, kv], attn.subln.weight, cfg.rms_norm_eps) * (1 - lambda_init))
        maps.append(a1 - lam * a2)
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T, torch.stack(maps, dim=1)


def reference_v2(attn: DiffAttentionV2, x, cos, sin, mask):
    cfg, d = attn.config, attn.head_dim
    h, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    q = rotate((x @ attn.q_proj.weight.T).view(B, L, 2 * h, d), cos, sin)
    k = rotate((x @ attn.k_proj.weight.T).view(B, L, h_kv, d), cos, sin)
    v = (x @ attn.v_proj.weight.T).view(B, L, h_kv, d)
    lam = torch.sigmoid(x @ attn.lambda_proj.weight.T)  # (B, L, h)
    heads, maps = [], []
    for i in range(h):
        signal, noise = 2 * i, 2 * i + 1
        kv = signal // (2 * h // h_kv)
        assert kv == noise // (2 * h // h_kv)  # the pair shares a GQA group
        a1 = softmax_map(q[:, :, signal], k[:, :, kv], mask, d**-0.5)
        a2 = softmax_map(q[:, :, noise], k[:, :, kv], mask, d**-0.5)
        heads.append(a1 @ v[:, :, kv] - lam[:, :, i, None] * (a2 @ v[:, :, kv]))
        maps.append(a1 - lam[:, :, i, None] * a2)
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T, torch.stack(maps, dim=1)


def reference_dex(attn: DexAttention, x, cos, sin, mask, selected):
    cfg, d = attn.config, attn.head_dim
    h, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    q = rotate((x @ attn.q_proj.weight.T).view(B, L, h, d), cos, sin)
    k = rotate((x @ attn.k_proj.weight.T).view(B, L, h_kv, d), cos, sin)
    v = (x @ attn.v_proj.weight.T).view(B, L, h_kv, d)
    heads = []
    for i in range(h):
        kv = i // (h // h_kv)
        o = softmax_map(q[:, :, i], k[:, :, kv], mask, d**-0.5) @ v[:, :, kv]
        if i in selected:
            o = o - attn.dex_lambda.lambda_learn * (o @ attn.dex_proj.weight.T)
        heads.append(o)
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T


def build(cls, mode, layer_idx=1, **overrides):
    torch.manual_seed(layer_idx)
    attn = cls(tiny_config(mode, **overrides), layer_idx=layer_idx).eval()
    attn.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in attn.parameters():  # every weight non-trivial, subln and f_D included
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    return attn


@pytest.mark.parametrize("pad_left", [[0, 0], [0, 3]])
@pytest.mark.parametrize("cls, mode, reference", [(DiffAttentionV1, "v1", reference_v1), (DiffAttentionV2, "v2", reference_v2)])
def test_differential_attention_matches_reference(cls, mode, reference, pad_left):
    attn = build(cls, mode)
    x, (cos, sin), mask = torch.randn(B, L, 64), rope_tables(L, attn.head_dim), causal_padding_mask(pad_left)
    out, maps = attn(x, (cos, sin), attention_mask=mask)
    ref_out, ref_maps = reference(attn, x, cos, sin, mask)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(maps, ref_maps, atol=1e-5, rtol=1e-5)


def test_dex_matches_reference_on_selected_heads_only():
    attn = build(DexAttention, "dex", dex_heads=[[0, 2], [1, 3]])
    x, (cos, sin), mask = torch.randn(B, L, 64), rope_tables(L, attn.head_dim), causal_padding_mask([0, 2])
    out, _ = attn(x, (cos, sin), attention_mask=mask)
    torch.testing.assert_close(out, reference_dex(attn, x, cos, sin, mask, {1, 3}), atol=1e-5, rtol=1e-5)


def test_dex_lambda_schedule():
    """lambda(t) = (1 - a) (t/T) lambda_init + a lambda_learn, a = min(1, t/T); lambda(0) = 0."""
    attn = build(DexAttention, "dex", anneal_steps=10)
    lambda_init, lambda_learn = depth_lambda_init(1), attn.dex_lambda.lambda_learn.item()
    for t in (0, 3, 10, 25):
        attn.anneal_step.fill_(t)
        a = min(1.0, t / 10)
        assert attn.current_lambda().item() == pytest.approx((1 - a) * (t / 10) * lambda_init + a * lambda_learn)


def test_v2_anneal_factor_scales_the_noise_term():
    """With anneal_steps T the noise weight is min(1, t/T) * sigmoid(lambda_proj(x)); at t = 0 only signal heads."""
    attn = build(DiffAttentionV2, "v2", anneal_steps=4)
    x = torch.randn(B, L, 64)
    for t, factor in ((0, 0.0), (1, 0.25), (9, 1.0)):
        attn.anneal_step.fill_(t)
        expected = factor * torch.sigmoid(x @ attn.lambda_proj.weight.T)
        torch.testing.assert_close(attn.noise_weight(attn.lambda_proj(x)), expected)


def test_lambda_init_follows_depth_schedule():
    from conftest import tiny_model

    model = tiny_model("v1", num_hidden_layers=6)
    for layer_idx, layer in enumerate(model.model.layers):
        assert layer.self_attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * layer_idx))
    constant = tiny_model("v1", num_hidden_layers=2, lambda_init=0.5)
    assert [layer.self_attn.lambda_init for layer in constant.model.layers] == [0.5, 0.5]


def test_lambda_at_initialisation_has_std_016():
    """d = 128, lambda_std_dev = 0.1: lambda - lambda_init = exp(q1.k1) - exp(q2.k2) has std ~0.16.

    Each dot product of two N(0, 0.1) vectors of length 128 has variance 128 * 0.1^4 = 0.0128; exp of it is
    near log-normal with variance (e^s2 - 1) e^s2 = 0.01305, and the difference of two has std 0.1616.
    """
    config = tiny_config("v1", hidden_size=8, num_attention_heads=1, num_key_value_heads=1, head_dim=128)
    torch.manual_seed(0)
    draws = torch.stack([DiffAttentionV1(config, layer_idx=0).diff_lambda() for _ in range(3000)])
    lambda_init = depth_lambda_init(0)
    assert abs(draws.mean().item() - lambda_init) < 0.01
    assert draws.std().item() == pytest.approx(0.1616, abs=0.012)
