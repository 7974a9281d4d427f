"""Needle-in-a-haystack: prompt construction checked by decoding, accuracy checked with language models whose
retrieval is known by construction (a perfect copier, a copier that only sees the first half of its context)."""

import json
import random
from types import SimpleNamespace

import pytest
import torch
from ecosystem_helpers import byte_tokenizer, tiny_config
from torch import nn

from modeling_diff import DiffLlamaForCausalLM
from modeling_diff.data import shakespeare
from modeling_diff.diagnostics import needle_attention_share
from modeling_diff.needle import (
    KEYS,
    NeedlePromptBuilder,
    default_lengths,
    evaluate_needles,
    main,
    make_needles,
    plot_needle_heatmap,
)

HAYSTACK = shakespeare("macbeth")[:4000]


class CopyingLM(nn.Module):
    """Predicts the token that followed the longest earlier match of the text so far: it retrieves every needle.
    With `sees_first` = f it may only copy from the first f of its input, so it misses needles placed later."""

    def __init__(self, vocab_size: int, sees_first: float = 1.0):
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=4096)
        self.anchor = nn.Parameter(torch.zeros(()))  # gives the model a device
        self.vocab_size, self.sees_first = vocab_size, sees_first

    def forward(self, input_ids, logits_to_keep=0, use_cache=False):
        ids = input_ids[0].tolist()
        limit = int(self.sees_first * len(ids))
        positions = range(len(ids) - logits_to_keep, len(ids))
        logits = torch.zeros(1, len(positions), self.vocab_size)
        for row, t in enumerate(positions):
            best, prediction = 0, 0
            for j in range(min(t, limit - 1)):  # ids[j] matched against ids[t]; the prediction is ids[j + 1]
                k = 0
                while k <= j and ids[j - k] == ids[t - k]:
                    k += 1
                if k >= best:
                    best, prediction = k, ids[j + 1]
            logits[0, row, prediction] = 1.0
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def test_prompts_place_the_needles(tokenizer):
    builder = NeedlePromptBuilder(tokenizer, HAYSTACK)
    needles = make_needles(3, random.Random(0))
    for depth in (0.0, 0.5, 1.0):
        prompts = builder.build(400, depth, needles, 2, random.Random(1))
        assert len(prompts) == 2
        read = [len(p.input_ids) + len(p.answer_ids) - 1 for p in prompts]  # teacher forcing reads answer[:-1]
        assert max(read) == 400
        text = tokenizer.decode(prompts[0].input_ids)
        for needle in needles:  # every needle, queried or not, is in the context once
            assert text.count(f"The special magic number for {needle.key} is {needle.value}.") == 1
        for prompt, needle in zip(prompts, needles):
            start, end = prompt.value_span
            assert tokenizer.decode(prompt.input_ids[start:end]) == " " + needle.value
            assert tokenizer.decode(prompt.answer_ids) == " " + needle.value
            assert tokenizer.decode(prompt.input_ids).endswith(f"What is the special magic number for {needle.key}? "
                                                               f"The special magic number for {needle.key} is")
        head = len(tokenizer.encode(f" The special magic number for {needles[0].key} is"))
        start = prompts[0].value_span[0] - head  # where the first queried needle begins
        question = len(tokenizer.encode(f"\n\nWhat is the special magic number for {needles[0].key}? "
                                        f"The special magic number for {needles[0].key} is"))
        if depth == 0.0:
            assert start == 0
        if depth == 1.0:  # the second queried needle ends (value, then ".") where the question begins
            assert prompts[1].value_span[1] + 1 == len(prompts[0].input_ids) - question


def test_prompt_length_must_hold_the_needles(tokenizer):
    builder = NeedlePromptBuilder(tokenizer, HAYSTACK)
    with pytest.raises(ValueError, match="lengths must leave room"):
        builder.build(60, 0.5, make_needles(2, random.Random(0)), 1, random.Random(0))
    with pytest.raises(ValueError, match="haystack"):
        NeedlePromptBuilder(tokenizer, "")


def test_make_needles():
    needles = make_needles(5, random.Random(0))
    assert len({n.key for n in needles}) == 5 and all(len(n.value) == 4 and n.value.isdigit() for n in needles)
    for count in (0, len(KEYS) + 1):
        with pytest.raises(ValueError, match="num_needles"):
            make_needles(count, random.Random(0))


def test_accuracy_grid_of_known_models(tokenizer):
    depths = [0.0, 0.1, 0.9, 1.0]
    kwargs = dict(lengths=[800, 1000], depths=depths, num_needles=3, num_queries=2, trials=2, haystack=HAYSTACK,
                  progress=False)
    perfect = evaluate_needles(CopyingLM(len(tokenizer)), tokenizer, **kwargs)
    assert perfect.accuracy == [[1.0] * 4, [1.0] * 4]
    assert all(logprob < 0 for row in perfect.answer_logprob for logprob in row)  # one-hot logits: finite log-probs
    # Sees the first half of the prompt: the queried needles at depth <= 10% of the filler (they end before
    # token 800 * 0.1 + 3 needles of about 45 tokens) are found, at >= 90% missed.
    half = evaluate_needles(CopyingLM(len(tokenizer), sees_first=0.5), tokenizer, **kwargs)
    assert half.accuracy == [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert "mean 0.500" in half.summary()
    assert half.to_dict()["accuracy"] == half.accuracy
    ax = plot_needle_heatmap(half)
    assert len(ax.texts) == 8
    import matplotlib.pyplot as plt

    plt.close("all")


def test_a_cell_retrieved_whole_reads_exactly_one_whatever_its_answers(tokenizer):
    """Each answer's share was added to the cell (1/10 ten times): 0.9999999999999999 for a cell of 10 answers all
    retrieved, written so to needle.json. The answers are counted and divided once."""
    for trials, queries in ((10, 1), (7, 1), (5, 2)):
        result = evaluate_needles(CopyingLM(len(tokenizer)), tokenizer, lengths=[400], depths=[0.5], num_needles=2,
                                  num_queries=queries, trials=trials, haystack=HAYSTACK, progress=False)
        assert result.accuracy == [[1.0]], (trials, queries)


def test_a_length_the_check_admits_holds_every_draw_and_a_shorter_one_is_refused_before_any_cell(tokenizer,
                                                                                                  monkeypatch):
    """The check took the keys longest in characters and queried the first of them: a draw that queried Santiago
    (about one in 30) needed a token more, and the evaluation raised after 13 prompts were scored."""
    import modeling_diff.needle as needle

    scored = []
    monkeypatch.setattr(needle, "score_prompt", lambda model, prompt: (scored.append(len(prompt.input_ids)),
                                                                         (True, 0.0))[1])
    fixed = NeedlePromptBuilder(tokenizer, HAYSTACK).most_fixed_tokens(2)
    model = CopyingLM(len(tokenizer))
    evaluate_needles(model, tokenizer, lengths=[fixed + 1], depths=[0.5], num_needles=2, num_queries=2, trials=300,
                     haystack=HAYSTACK, progress=False)
    assert len(scored) == 600
    scored.clear()
    with pytest.raises(ValueError, match=f"lengths must leave room for filler text: {fixed} tokens hold no more"):
        evaluate_needles(model, tokenizer, lengths=[fixed + 1, fixed], depths=[0.5], num_needles=2, num_queries=1,
                         haystack=HAYSTACK, progress=False)
    assert scored == []


def test_evaluate_rejects_bad_grids(tokenizer):
    model = CopyingLM(len(tokenizer))
    bad = [
        (dict(depths=[1.5]), "depths"),
        (dict(num_needles=2, num_queries=3), "num_queries"),
        (dict(lengths=[8192]), "max_position_embeddings"),
        (dict(lengths=[0]), "lengths"),
        (dict(trials=0), "trials"),
        (dict(lengths=[100, 60]), "lengths must leave room"),  # refused before any cell runs
    ]
    for kwargs, field in bad:
        with pytest.raises(ValueError, match=field):
            evaluate_needles(model, tokenizer, **{"lengths": [200], "haystack": HAYSTACK, **kwargs})


def test_default_lengths_and_haystack():
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096))
    assert default_lengths(model) == [1024, 2048, 4096]
    with pytest.raises(ValueError, match=r"lengths must be given: the default starts at 8192 tokens, above the "
                                         r"model's max_position_embeddings \(4096\)"):
        default_lengths(model, start=8192)
    assert "Macbeth" in HAYSTACK and "**" not in HAYSTACK and "#" not in HAYSTACK


def test_needle_attention_share_of_uniform_attention(tokenizer):
    """With q_proj = 0 every map is uniform over the prompt, so the share on the value is len(value) / len(prompt)."""
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config("dex", max_position_embeddings=512)).eval()
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data.zero_()
    shares = needle_attention_share(model, tokenizer, [200, 300], haystack=HAYSTACK, progress=False)
    assert shares.shape == (2, 2, 4)
    value_tokens = len(tokenizer.encode(" 1234"))
    for row, length in zip(shares, [200, 300]):  # the prompt leaves room for the answer read after it
        torch.testing.assert_close(row, torch.full_like(row, value_tokens / (length - value_tokens + 1)))


def test_needle_attention_share_measures_in_eval_mode_and_leaves_the_mode(tokenizer):
    """A model in training mode (as its constructor leaves it) with attention dropout gave random shares: the probe
    ran with dropout on. Measured in eval mode, as diagnose and evaluate_needles measure, and the mode restored."""
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config("v2", max_position_embeddings=512, attention_dropout=0.3))
    assert model.training
    shares = [needle_attention_share(model, tokenizer, [200], haystack=HAYSTACK, progress=False) for _ in range(2)]
    assert model.training
    torch.testing.assert_close(shares[0], shares[1], rtol=0, atol=0)
    torch.testing.assert_close(shares[0], needle_attention_share(model.eval(), tokenizer, [200], haystack=HAYSTACK,
                                                                 progress=False), rtol=0, atol=0)


def test_command_line_on_a_real_model(tokenizer, tmp_path):
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config("v2", max_position_embeddings=512))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "haystack.txt").write_text(HAYSTACK)
    out = tmp_path / "results"
    result = main([str(tmp_path / "model"), "--lengths", "256", "512", "--depths", "0", "1", "--needles", "2",
                   "--haystack", str(tmp_path / "haystack.txt"), "--out", str(out)])
    saved = json.loads((out / "needle.json").read_text())
    assert saved["lengths"] == [256, 512] and saved["accuracy"] == result.accuracy
    assert (out / "needle.png").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".needle-")] == []  # no staging dir left
