"""Attention-noise diagnostics: every measure against a case computed by hand here, the probe against
transformers' own eager attention, the interventions against the formulas they implement."""

import math
import re
import shlex
import statistics
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import repeat_kv

from modeling_diff import diagnostics as D


def _all(shape):
    return torch.ones(shape, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------- measures


def test_entropy_by_hand():
    # Two queries of one head: the first sees keys 0-1, the second keys 0-2.
    maps = torch.tensor([[[[0.5, 0.5, 0.7], [0.25, 0.25, 0.5]]]])  # 0.7 is masked out
    valid = torch.tensor([[[[True, True, False], [True, True, True]]]])
    rows = _all((1, 1, 2))
    expected = (math.log(2) + 1.5 * math.log(2)) / 2  # H(1/2, 1/2) = ln 2; H(1/4, 1/4, 1/2) = 1.5 ln 2
    assert D.attention_entropy(maps, valid, rows).item() == pytest.approx(expected, rel=1e-6)
    # A signed map: |w| normalised -> (3/7, 1/7, 3/7).
    signed = torch.tensor([[[[0.6, -0.2, 0.6]]]])
    expected = -(2 * 3 / 7 * math.log(3 / 7) + 1 / 7 * math.log(1 / 7))
    assert D.attention_entropy(signed, _all((1, 1, 1, 3)), _all((1, 1, 1))).item() == pytest.approx(expected, rel=1e-6)
    # A row left out of `rows` does not count.
    rows = torch.tensor([[[True, False]]])
    assert D.attention_entropy(maps, valid, rows).item() == pytest.approx(math.log(2), rel=1e-6)


def test_negative_mass_by_hand():
    maps = torch.tensor([[[[0.6, -0.2, -0.1, -5.0], [1.0, 0.0, 0.0, 0.0]]], [[[0.5, 0.5, 0.0, 0.0], [0.3, -0.4, 0.0, 0.0]]]])
    valid = torch.tensor([[[[True, True, True, False], [True] * 4]], [[[True] * 4, [True] * 4]]])  # -5.0 masked
    rows = _all((2, 1, 2))
    assert D.negative_mass(maps, valid, rows).item() == pytest.approx((0.3 + 0.0 + 0.0 + 0.4) / 4)


def test_noise_correlation_by_hand():
    signal = [0.7, 0.1, 0.1, 0.05, 0.05]
    noise = [0.1, 0.3, 0.2, 0.2, 0.2]
    differential = [s - 0.5 * n for s, n in zip(signal, noise)]  # key 0 is the salient one
    t = lambda values: torch.tensor(values)[None, None, None]  # noqa: E731  (1, 1, 1, S)
    # Independent reference: statistics.correlation over the keys left when key 0 is removed.
    expected = statistics.correlation(signal[1:], noise[1:])
    got = D.noise_correlation(t(signal), t(noise), t(differential), _all((1, 1, 1, 5)), _all((1, 1, 1)), num_salient=1)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    expected_all = statistics.correlation(signal, noise)
    got_all = D.noise_correlation(t(signal), t(noise), t(differential), _all((1, 1, 1, 5)), _all((1, 1, 1)), num_salient=0)
    assert got_all.item() == pytest.approx(expected_all, rel=1e-5)
    # Masked keys are ignored; a query with fewer than 3 keys left is skipped (NaN when it is the only one).
    valid = torch.tensor([[[[True, True, True, True, False]]]])
    expected_masked = statistics.correlation(signal[1:4], noise[1:4])
    assert D.noise_correlation(t(signal), t(noise), t(differential), valid, _all((1, 1, 1))).item() == pytest.approx(
        expected_masked, rel=1e-5)
    short = torch.tensor([[[[True, True, True, False, False]]]])
    assert torch.isnan(D.noise_correlation(t(signal), t(noise), t(differential), short, _all((1, 1, 1)))).all()
    with pytest.raises(ValueError, match="num_salient"):
        D.noise_correlation(t(signal), t(noise), t(differential), valid, _all((1, 1, 1)), num_salient=-1)


def test_outlier_stats_by_hand():
    values = torch.randperm(150).float()[None] + 1  # 1..150 shuffled
    stats = D.outlier_stats(values)
    assert stats["top1"].item() == 150 and stats["top100"].item() == 51 and stats["median"].item() == 75
    odd = torch.tensor([[3.0, 1.0, 2.0, 9.0, 4.0]])
    stats = D.outlier_stats(odd)
    assert stats["top1"].item() == 9 and stats["median"].item() == 3 and torch.isnan(stats["top100"]).all()


def test_absmax_quantize_by_hand():
    logits = torch.tensor([[[[1.0, -0.26, 0.3, 9.0]]]])  # 9.0 is masked, so absmax = 1
    valid = torch.tensor([[[[True, True, True, False]]]])
    # 4 bits: 7 levels each side, step 1/7; -0.26 * 7 = -1.82 -> -2; 0.3 * 7 = 2.1 -> 2.
    got = D.absmax_quantize(logits, 4, valid)[0, 0, 0, :3]
    assert torch.allclose(got, torch.tensor([1.0, -2 / 7, 2 / 7]))
    # 8 bits: step 1/127.
    got = D.absmax_quantize(logits, 8, valid)[0, 0, 0, :3]
    assert torch.allclose(got, torch.tensor([1.0, -33 / 127, 38 / 127]))
    with pytest.raises(ValueError, match="bits"):
        D.absmax_quantize(logits, 1, valid)


def test_needle_share_by_hand():
    maps = torch.tensor([[[0.1, 0.5, -0.2, 0.4, 0.2]], [[0.2, 0.2, 0.2, 0.2, 0.2]]])  # (B=2, H=1, S=5)
    valid = _all((2, 1, 5))
    expected = (0.5 / 1.4 + 0.2 / 1.0) / 2
    assert D.needle_share(maps, valid, (1, 2)).item() == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------- the probe


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    return ids, mask


def _real_targets(ids, mask):
    """The labels of the loss of real tokens: a target where it and the token before it (whose query predicts it)
    are real, -100 elsewhere."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100
    return labels


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _record(model, ids, mask, **kwargs):
    layers = []
    with D.AttentionProbe(model, layers.append, **kwargs):
        model(input_ids=ids, attention_mask=mask)
    return layers


@pytest.mark.parametrize("mode", ["v1", "v2", "dex", "llama"])
@torch.no_grad()
def test_probe_matches_eager_attention(mode):
    """The probe's maps are the ones transformers' eager attention returns with output_attentions; its pairs
    combine to them with the model's lambda; its logits give its maps through softmax; the model is restored."""
    model = _llama() if mode == "llama" else tiny_model(mode)
    if mode == "v2":
        D.decoder_layers(model)[0].self_attn.lambda_proj.weight.data.normal_(0, 1.0)  # token-dependent weights
    ids, mask = _batch()
    model.set_attn_implementation("eager")
    reference = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    layers = _record(model, ids, mask)
    assert model.config._attn_implementation == "eager"
    assert [layer.layer_idx for layer in layers] == [0, 1]
    for layer, eager_map in zip(layers, reference.attentions):
        torch.testing.assert_close(layer.maps, eager_map.float(), atol=1e-6, rtol=1e-5)
        masked = layer.logits.masked_fill(~layer.valid, -torch.inf).softmax(-1)
        fully_masked = ~layer.valid.any(-1, keepdim=True)  # left-padded queries: eager makes them uniform
        torch.testing.assert_close(torch.where(fully_masked, layer.probs, masked), layer.probs)
        assert layer.paired == (mode in ("v1", "v2"))
        if mode == "v1":
            lam = D.decoder_layers(model)[layer.layer_idx].self_attn.diff_lambda()
            torch.testing.assert_close(layer.signal - lam * layer.noise, layer.maps, atol=1e-6, rtol=1e-5)
    probed_loss = D.lm_loss(model, ids, mask)
    labels = _real_targets(ids, mask)
    assert probed_loss == pytest.approx(float(model(input_ids=ids, attention_mask=mask, labels=labels).loss), rel=1e-5)


def test_quantized_logits_sit_on_the_absmax_grid():
    model = tiny_model("v1")
    ids, mask = _batch()
    for bits in (4, 6):
        for layer in _record(model, ids, mask, logit_bits=bits):
            step = torch.where(layer.valid, layer.logits.abs(), 0).amax(dim=(-2, -1), keepdim=True) / (2 ** (bits - 1) - 1)
            ratio = layer.logits / step
            assert torch.allclose(ratio[layer.valid.expand_as(ratio)], ratio[layer.valid.expand_as(ratio)].round(), atol=1e-4)
    # Many bits change nothing measurable; 2 bits (levels -1, 0, 1) does.
    full = D.lm_loss(model, ids, mask)
    assert D.lm_loss(model, ids, mask, logit_bits=16) == pytest.approx(full, abs=1e-5)
    assert D.lm_loss(model, ids, mask, logit_bits=2) != pytest.approx(full, abs=1e-6)


def _with_negative_weights(mode):
    """A tiny model whose differential maps have negative entries: large lambda (V1), sharp maps and
    token-dependent weights (V2)."""
    model = tiny_model(mode, seed=3)
    for layer in D.decoder_layers(model):
        attention = layer.self_attn
        attention.q_proj.weight.data *= 30  # sharp maps, so A2 > A1 on some keys
        if mode == "v1":
            attention.diff_lambda.lambda_q1.data.fill_(0.5)
            attention.diff_lambda.lambda_k1.data.fill_(0.5)  # exp(d / 4) - exp(~0) + lambda_init: well above 1
        else:
            attention.lambda_proj.weight.data.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_clamping_negative_weights(mode):
    """With clamp_negative, the layer applies max(0, A1 - w A2) to V: its returned map is the ReLU of the
    eager differential map, and the output equals the model run with that map put in by hand (layer 0)."""
    model = _with_negative_weights(mode)
    ids, _ = _batch()
    model.set_attn_implementation("eager")
    eager = model(input_ids=ids, output_attentions=True).attentions
    assert (eager[0] < 0).any(), "the test needs negative differential weights"
    clamped = _record(model, ids, None, clamp_negative=True)
    torch.testing.assert_close(clamped[0].maps, eager[0].float().clamp_min(0), atol=1e-6, rtol=1e-5)

    # Layer 0's output: A1 -> relu(D) and A2 -> 0 make A1 V - w A2 V = relu(D) V; compute it with eager by
    # swapping the maps through a one-off attention function.
    def by_hand(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        d_map = eager[module.layer_idx].float().clamp_min(0)  # (B, h, L, S)
        probs = torch.stack([d_map, torch.zeros_like(d_map)], dim=2).flatten(1, 2)
        value = repeat_kv(value, module.num_key_value_groups)
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("test_by_hand", by_hand)
    AttentionMaskInterface.register("test_by_hand", eager_mask)
    outputs = {}
    hook = D.decoder_layers(model)[0].register_forward_hook(lambda m, a, o: outputs.setdefault(len(outputs), o))
    model.set_attn_implementation("test_by_hand")
    model(input_ids=ids)
    with D.AttentionProbe(model, clamp_negative=True):
        model(input_ids=ids)
    hook.remove()
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    model.set_attn_implementation("eager")
    assert D.lm_loss(model, ids, clamp_negative=True) != pytest.approx(D.lm_loss(model, ids), abs=1e-6)


def test_clamping_is_refused_without_differential_maps():
    for model in (tiny_model("dex"), _llama()):
        with pytest.raises(ValueError, match="clamp_negative"):
            D.AttentionProbe(model, clamp_negative=True)
    with pytest.raises(ValueError, match="logit_bits"):
        D.AttentionProbe(tiny_model("v1"), logit_bits=1)


# ---------------------------------------------------------------------------------------------- diagnose


@pytest.mark.parametrize("mode", ["v1", "dex", "llama"])
@torch.no_grad()
def test_diagnose_report(mode):
    model = _llama() if mode == "llama" else _with_negative_weights(mode) if mode == "v1" else tiny_model(mode)
    ids, mask = _batch()
    model.set_attn_implementation("eager")  # the reference: eager and sdpa differ on left-padded query rows
    report = D.diagnose(model, ids, mask, bits=(8, 4), progress=False)
    heads = 4
    assert report.entropy.shape == report.negative_mass.shape == (2, heads)
    assert all(report.logit_outliers[s].shape == (2, heads) for s in D.OUTLIER_STATS)
    assert all(report.hidden_outliers[s].shape == (2,) for s in D.OUTLIER_STATS)
    assert list(report.quantized_loss) == [8, 4]
    labels = _real_targets(ids, mask)
    assert report.loss == pytest.approx(float(model(input_ids=ids, attention_mask=mask, labels=labels).loss), rel=1e-5)
    # Hidden-state outliers of layer 0, from the layer's own output on the real (unpadded) tokens.
    outputs = []
    hook = D.decoder_layers(model)[0].register_forward_hook(lambda m, a, o: outputs.append(o))
    model(input_ids=ids, attention_mask=mask)
    hook.remove()
    real = outputs[0][mask.bool()].abs().flatten()
    assert report.hidden_outliers["top1"][0].item() == pytest.approx(real.max().item())
    assert report.hidden_outliers["top100"][0].item() == pytest.approx(real.sort(descending=True).values[99].item())
    if mode == "v1":
        assert report.noise_correlation.shape == report.signal_entropy.shape == (2, heads)
        assert report.clamped_loss is not None and (report.negative_mass > 0).any()
    else:  # one softmax map per head: no pairs, no negative weights
        assert report.noise_correlation is None and report.clamped_loss is None
        assert (report.negative_mass == 0).all()
    assert f"loss {report.loss:.4f}" in report.summary()
    assert set(report.to_dict()) >= {"entropy", "quantized_loss", "clamped_loss"}


@pytest.mark.parametrize("mode", ["v1", "dex"])
@torch.no_grad()
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_changes_no_measure_of_the_real_tokens(mode, side):
    """A real query never sees a key right of the text, but a padding query there sees the real keys before it: its
    logits counted in the logit outliers and in the absmax scale of the quantized loss, which moved with the amount
    of padding (top1 by 0.01-0.02, the 4-bit loss in its fourth decimal). With left padding the last pad's query
    predicted the first real token, a target the unpadded text does not have: the loss was of 16 targets, not 15
    (off by 8e-5 to 5e-3)."""
    model = tiny_model(mode)
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(0))
    alone = D.diagnose(model, ids, bits=(4,), progress=False)
    pads, ones = torch.full((1, 6), 89), torch.ones(1, 10, dtype=torch.long)
    padded = torch.cat([ids, pads] if side == "right" else [pads, ids], dim=1)
    mask = torch.cat([ones, torch.zeros_like(pads)] if side == "right" else [torch.zeros_like(pads), ones], dim=1)
    report = D.diagnose(model, padded, mask, bits=(4,), progress=False)
    assert report.loss == pytest.approx(alone.loss, rel=1e-6)
    assert report.quantized_loss[4] == pytest.approx(alone.quantized_loss[4], rel=1e-6)
    for stat in ("top1", "median"):
        torch.testing.assert_close(report.logit_outliers[stat], alone.logit_outliers[stat])
    torch.testing.assert_close(report.entropy, alone.entropy)


def test_diagnose_rejects_bad_inputs():
    model = tiny_model("v2")
    with pytest.raises(ValueError, match="input_ids"):
        D.diagnose(model, torch.ones(5, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="attention_mask"):
        D.diagnose(model, torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4), progress=False)


def _forward_counter(model):
    """A list that grows by one on every forward of `model`, and the hook to remove."""
    calls = []
    return calls, model.register_forward_pre_hook(lambda module, args: calls.append(1))


# bits=(100,) was a raw OverflowError after the first forward, bits=(2**40,) hung computing 2**(2**40 - 1).
@pytest.mark.parametrize("bits", [(100,), (2**40,), (25,), (1,), (0,), (-3,), (8, 8), (4.0,), (True,), ("8",), 8, "84"],
                         ids=repr)
def test_diagnose_refuses_bits_outside_its_range_before_any_forward(bits):
    model = tiny_model("v1").train()
    ids, mask = _batch()
    calls, hook = _forward_counter(model)
    with pytest.raises(ValueError, match=r"bits must be a (tuple|sequence) of distinct integers in \[2, 24\]"):
        D.diagnose(model, ids, mask, bits=bits, progress=False)
    hook.remove()
    assert calls == [] and model.training and model.config._attn_implementation == "eager"


def test_bits_range_ends_are_accepted_and_the_probe_refuses_the_same_values():
    model = tiny_model("v1")
    ids, mask = _batch()
    report = D.diagnose(model, ids, mask, bits=(24, 2), progress=False)
    assert list(report.quantized_loss) == [24, 2]
    assert report.quantized_loss[24] == pytest.approx(report.loss, abs=1e-5)  # float32's own resolution
    for bits in (100, 25, 2**40, 1, 4.0, True):
        with pytest.raises(ValueError, match=r"logit_bits must be None or an integer in \[2, 24\]"):
            D.AttentionProbe(model, logit_bits=bits)
        with pytest.raises(ValueError, match=r"bits must be an integer in \[2, 24\]"):
            D.absmax_quantize(torch.ones(1, 1, 1, 2), bits, _all((1, 1, 1, 2)))
    assert model.config._attn_implementation == "eager"


# 1.5 was a raw TypeError from topk (V1, V2); 10 and 100 left fewer than 3 non-salient keys to every query, and
# noise_correlation came back all NaN; Llama and DEX took -1 without a look.
@pytest.mark.parametrize("mode", ["v1", "v2", "dex", "llama"])
@pytest.mark.parametrize("num_salient", [1.5, -1, 10, 100, True, None, "1"])
def test_diagnose_refuses_num_salient_outside_its_range_before_any_forward(mode, num_salient):
    model = (_llama() if mode == "llama" else tiny_model(mode)).train()
    ids, mask = _batch()  # the longest row has 12 real tokens: at most 12 - 3 = 9 salient keys leave 3
    calls, hook = _forward_counter(model)
    with pytest.raises(ValueError, match=r"num_salient must be an integer in \[0, 9\] .*12 real tokens"):
        D.diagnose(model, ids, mask, num_salient=num_salient, progress=False)
    hook.remove()
    assert calls == [] and model.training


def test_num_salient_at_its_upper_end_leaves_a_correlation():
    model = tiny_model("v1")
    ids, mask = _batch()
    report = D.diagnose(model, ids, mask, bits=(), num_salient=9, progress=False)
    assert not report.noise_correlation.isnan().any()  # the last query of the full row keeps 3 keys
    with pytest.raises(ValueError, match=r"num_salient must be an integer in \[0, 1\] .*4 real tokens"):
        D.diagnose(model, ids[:, :4], num_salient=2, progress=False)
    with pytest.raises(ValueError, match=r"num_salient: .*needs 3 keys left.* only 2 real tokens"):
        D.diagnose(model, ids[:, :2], num_salient=0, progress=False)


def _assert_unprobed(model):
    assert model.config._attn_implementation == "eager" and D._PROBES == {}
    for layer in D.decoder_layers(model):
        assert not layer.self_attn._forward_hooks and not layer.self_attn._forward_pre_hooks
        assert not layer._forward_hooks


# A probe inside a probe was a bare KeyError: <id> from the outer probe's hook, after the inner one had taken the
# model's attention over and, on its exit, removed the outer one's registration.
def test_a_second_probe_on_the_same_model_is_refused_and_the_first_keeps_working():
    model = tiny_model("v1")
    ids, mask = _batch()
    layers = []
    with D.AttentionProbe(model, layers.append):
        with pytest.raises(ValueError, match="an AttentionProbe is already attached to this model"):
            with D.AttentionProbe(model, logit_bits=4):
                model(input_ids=ids, attention_mask=mask)
        with pytest.raises(ValueError, match="an AttentionProbe is already attached to this model"):
            D.lm_loss(model, ids, mask)
        model.train()
        with pytest.raises(ValueError, match="an AttentionProbe is already attached to this model"):
            D.diagnose(model, ids, mask, progress=False)
        assert model.training
        model.eval()
        model(input_ids=ids, attention_mask=mask)  # the outer probe still records, unquantized
    assert [layer.layer_idx for layer in layers] == [0, 1]
    _assert_unprobed(model)
    with torch.no_grad():
        loss = float(model(input_ids=ids, attention_mask=mask, labels=_real_targets(ids, mask)).loss)
    assert D.lm_loss(model, ids, mask) == pytest.approx(loss, rel=1e-5)


def test_a_probe_that_fails_half_attached_leaves_the_model_as_it_was(monkeypatch):
    model = tiny_model("v2")

    def failing(*args, **kwargs):
        raise RuntimeError("hook refused")

    monkeypatch.setattr(D.decoder_layers(model)[1].self_attn, "register_forward_hook", failing)  # after layer 0
    with pytest.raises(RuntimeError, match="hook refused"):
        with D.AttentionProbe(model):
            pass
    _assert_unprobed(model)


# ---------------------------------------------------------------------------------------------- README


def _readme_blocks(language: str) -> list[str]:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("<!-- section:diagnostics -->")[1].split("<!-- /section:diagnostics -->")[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_readme_snippets_run(tmp_path, monkeypatch, request):
    """Every python block of the README's diagnostics section, then its command line on a saved tiny model."""
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODELING_DIFF_CACHE", str(request.config.cache.mkdir("modeling_diff")))  # SmolLM2 copy
    blocks = _readme_blocks("python")
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})

    from ecosystem_helpers import byte_tokenizer, tiny_config

    from modeling_diff import DiffLlamaForCausalLM
    from modeling_diff.needle import main

    DiffLlamaForCausalLM(tiny_config("v1", max_position_embeddings=1024)).save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    (command,) = _readme_blocks("bash")
    argv = shlex.split(command.split("#")[0].replace("MODEL_DIR", str(tmp_path / "model")))
    assert argv[:3] == ["python", "-m", "modeling_diff.needle"]
    main(argv[3:])
    assert (tmp_path / "results" / "needle.png").is_file()
    import matplotlib.pyplot as plt

    plt.close("all")
