"""pipeline("text-generation") with a DiffLlama and a tokenizer gives the text of a greedy decode written here."""

import pytest
import torch
from ecosystem_helpers import byte_tokenizer, readme_snippet, tiny_config
from transformers import pipeline

from modeling_diff import DiffLlamaForCausalLM


def greedy_text(model, tokenizer, prompt: str, new_tokens: int) -> str:
    """Reference decode: argmax of the full forward pass, one token at a time, no cache."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    return tokenizer.decode(ids[0])


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_text_generation_pipeline(mode):
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config(mode)).eval()
    if mode == "dex":  # a fresh DEX layer is Llama attention; make the differential term count
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.dex_proj.weight.normal_(0, 0.3)
    tokenizer = byte_tokenizer()
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompt = "To be, or not to be"
    # min_new_tokens: the reference decode does not stop at EOS either
    out = generator(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert out[0]["generated_text"] == greedy_text(model, tokenizer, prompt, 12)

    batch = generator(["Alas, poor Yorick", "O"], max_new_tokens=5, min_new_tokens=5, do_sample=False,
                      batch_size=2)  # left padding, with an attention mask
    assert [b[0]["generated_text"] for b in batch] == [greedy_text(model, tokenizer, p, 5)
                                                        for p in ("Alas, poor Yorick", "O")]


def test_text_generation_pipeline_by_path_loads_the_package_s_class(tmp_path):
    """pipeline("text-generation", model=<saved folder>) looks config.json's architectures[0] up in transformers'
    namespace, finds nothing (it names `modeling_diff.DiffLlamaForCausalLM`) and falls back to AutoModelForCausalLM,
    which builds ours: never transformers' DiffLlama class with our weights."""
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config("v2")).eval()
    tokenizer = byte_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path))
    assert type(generator.model) is DiffLlamaForCausalLM
    prompt = "To be, or not to be"
    out = generator(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out[0]["generated_text"] == greedy_text(model, tokenizer, prompt, 8)


def test_readme_pipeline_snippet():
    scope = {}
    exec(readme_snippet("pipeline"), scope)
    assert scope["text"].startswith("Friends, Romans")
