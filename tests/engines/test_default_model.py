"""The embedded default model: built the same way everywhere, built once, and with a tokenizer
whose every token survives a decode and re-encode (so replies re-tokenize to what was generated)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from kvtier.engines import default_model
from kvtier.engines.default_model import CHARS, SIZES, SPECIAL_TOKENS, default_model_dir

TEXT = "The cache held 42 chunks; (and 3 more) were on SSD!\n  Indented: a . b , c ? don 't\n"
EVERY_CHAR = "".join(CHARS)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_two_builds_in_different_homes_are_identical(tmp_path, tiny_model_dir):
    a = default_model_dir("tiny", home=tmp_path / "a")
    b = default_model_dir("tiny", home=tmp_path / "b")
    assert a != b and a.name == b.name == tiny_model_dir.name

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and len(wa) > 0
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert (a / "config.json").read_text() == (b / "config.json").read_text()

    ta, tb = AutoTokenizer.from_pretrained(a), AutoTokenizer.from_pretrained(b)
    assert ta.get_vocab() == tb.get_vocab()
    assert ta.encode(TEXT) == tb.encode(TEXT)


def test_a_built_model_is_reused_not_rebuilt(tmp_path, monkeypatch):
    first = default_model_dir("tiny", home=tmp_path)
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns, weights.stat().st_ino

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the model was built again")

    monkeypatch.setattr(default_model, "_build", no_rebuild)
    again = default_model_dir("tiny", home=tmp_path)
    assert again == first
    assert (weights.stat().st_mtime_ns, weights.stat().st_ino) == stamp
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [first.name]  # no temp dirs left


def test_an_unknown_size_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError) as err:
        default_model_dir("huge", home=tmp_path)
    message = str(err.value)
    assert "huge" in message
    assert all(size in message for size in SIZES)
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


def test_a_build_leaves_the_global_rng_as_it_was(tmp_path):
    torch.manual_seed(2024)
    before = torch.random.get_rng_state()
    expected = torch.rand(5)
    torch.random.set_rng_state(before)

    default_model_dir("tiny", home=tmp_path)

    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(torch.rand(5), expected)


# -- tokenizer ---------------------------------------------------------------------------------
def test_text_round_trips_through_the_tokenizer(tokenizer):
    for text in (TEXT, EVERY_CHAR, " leading and trailing spaces ", "\n\n"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)  # one token per character
        assert tokenizer.decode(ids) == text


def test_every_token_decodes_to_text_that_encodes_back_to_it(tokenizer):
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(CHARS)
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        assert tokenizer.encode(text, add_special_tokens=False) == [token_id], (token_id, text)


def test_a_generated_reply_re_tokenizes_identically(tokenizer):
    # A reply is any sequence of tokens; decoded into a message and encoded again, it must give
    # back the same ids, or the next turn would miss the KV saved for it.
    g = torch.Generator().manual_seed(0)
    chars = [tokenizer.convert_tokens_to_ids(c) for c in CHARS]
    for _ in range(20):
        ids = [chars[i] for i in torch.randint(len(chars), (40,), generator=g).tolist()]
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def test_the_chat_template_renders_turns_and_the_generation_prompt(tokenizer):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    without = tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    assert rendered.startswith(without) and without.endswith("Bye<|eot_id|>")

    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.eos_token_id) == 4  # every turn ends with <|eot_id|>, the EOS
    assert tokenizer.decode(ids) == rendered
