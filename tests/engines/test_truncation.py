"""A chat that outgrows the context window, told on tiny models: the oldest turns go first and
the system prompt stays; without re-use the engine recomputes the truncated prompt exactly; with
re-use the kept turns' KV, saved by the previous turn at later positions, is rotated into place
instead of prefilled, at a small and measured cost in agreement (and rotating is what keeps the
cost small); a model whose RoPE cannot be shifted recomputes and says why."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from kvtier.engines import attention
from kvtier.engines.default_model import CHAT_TEMPLATE, build_tokenizer
from kvtier.engines.hf import EngineConfig, HFEngine, TurnResult, chat_prompt_ids
from kvtier.engines.rope import RotaryShift
from kvtier.engines.truncation import ShiftSpan, align, split_turns, truncate

from .conftest import (
    SYSTEM,
    C,
    Tiny,
    assert_same_as_recompute,
    chunk_file,
    prefill_lengths,
    saved_tokens,
)

WORDS = ["cache", "tier", "chunk", "prefix", "token", "layer", "disk", "host", "window", "turn",
         "reply", "query"]


def text(seed: int, chars: int) -> str:
    words = [WORDS[(seed * 7 + i * 5 + i // 3) % len(WORDS)] for i in range(chars)]
    return " ".join(words)[:chars]


QUESTIONS = [f"Question {i}: " + text(i, 90) for i in range(8)]


def fixed_chat(turns: int, answer_chars: int = 30) -> list[dict[str, str]]:
    """System prompt, ``turns`` answered questions, and one more question."""
    chat = [{"role": "system", "content": SYSTEM}]
    for i in range(turns):
        chat += [{"role": "user", "content": QUESTIONS[i]},
                 {"role": "assistant", "content": text(100 + i, answer_chars)}]
    return chat + [{"role": "user", "content": QUESTIONS[turns]}]


# -- the policy ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def render(tiny: Tiny):
    return lambda messages: chat_prompt_ids(tiny.tokenizer, messages)


def test_turns_start_at_user_messages_and_the_leading_system_messages_stand_apart():
    chat = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}]
    system, turns = split_turns(chat)
    assert system == (chat[0],)
    assert turns == ((chat[1],), (chat[2], chat[3]), (chat[4],))


def test_a_chat_that_fits_is_left_whole(render):
    chat = fixed_chat(3)
    ids = render(chat)
    cut = truncate(chat, render, window=len(ids) + 10, headroom=10)
    assert (cut.dropped_turns, cut.dropped_tokens, cut.ids) == (0, 0, ids)
    assert cut.messages() == chat


@pytest.mark.parametrize("headroom", [0, 8, 150])
def test_the_oldest_turns_are_dropped_first_and_the_system_prompt_is_kept(render, headroom):
    chat = fixed_chat(5)
    _system, turns = split_turns(chat)
    window = len(render(fixed_chat(2)))  # about three turns fit
    cut = truncate(chat, render, window, headroom)

    k = cut.dropped_turns
    assert 0 < k < len(turns) - 1
    assert cut.messages() == [chat[0]] + [m for t in turns[k:] for m in t]  # whole turns, oldest first
    assert cut.ids == render(cut.messages())
    assert len(cut.ids) + headroom <= window  # the reply's room is kept
    assert len(render(cut.messages(k - 1))) + headroom > window  # and no turn more was dropped
    assert cut.dropped_tokens == len(render(chat)) - len(cut.ids)
    if headroom == 150:  # more room for the reply costs more history
        assert k > truncate(chat, render, window, 0).dropped_turns


def test_a_chat_whose_system_prompt_and_last_turn_do_not_fit_is_refused(render):
    chat = fixed_chat(3)
    last = len(render([chat[0], chat[-1]]))
    assert truncate(chat, render, last, 0).dropped_turns == 3  # just fits: everything else goes
    with pytest.raises(ValueError, match=rf"take {last} tokens; with 1 tokens kept .* {last} tokens"):
        truncate(chat, render, last, 1)
    with pytest.raises(ValueError, match="do not fit"):
        truncate([chat[0]], render, 10, 0)


def test_alignment_demands_the_exact_tokens_of_head_and_kept_part():
    head = [1, 2, 3]
    source = head + [7, 7, 7, 7] + [4, 5, 6]
    assert align(source, head + [4, 5, 6], head) == ShiftSpan(head=3, delta=4)
    assert align(source, head + [4, 5, 9], head) is None  # the kept part differs
    assert align(source, [1, 2, 0, 4, 5, 6], head) is None  # the head differs
    assert align(source, source, head) is None  # nothing dropped


# -- the engine ---------------------------------------------------------------------------------
def window_for(engine: HFEngine, turns: int) -> int:
    """A window that holds the system prompt and about ``turns`` turns of these chats."""
    return len(engine.prompt_ids(fixed_chat(turns))) + 8


def chat_on(engine: HFEngine, questions: int) -> list[tuple[list[dict[str, str]], TurnResult]]:
    """The engine answers ``questions`` questions, its replies kept in the history."""
    history = [{"role": "system", "content": SYSTEM}]
    out = []
    for question in QUESTIONS[:questions]:
        history.append({"role": "user", "content": question})
        got = engine.generate(history)
        engine.wait_for_saves()
        out.append((list(history), got))
        history.append({"role": "assistant", "content": got.text})
    return out


def test_without_reuse_a_truncated_chat_is_recomputed_exactly(make_engine):
    probe = make_engine()
    engine = make_engine(context_window=window_for(probe, 3))
    turns = chat_on(engine, 7)
    truncated = [(h, got) for h, got in turns if got.dropped_turns]
    assert len(truncated) >= 3 and turns[0][1].dropped_turns == 0
    for history, got in truncated:
        cut = truncate(history, engine.prompt_ids, engine.context_window, 8)
        assert (got.dropped_turns, got.dropped_tokens) == (cut.dropped_turns, cut.dropped_tokens)
        assert got.prompt_tokens == len(cut.ids) and got.shifted_tokens == 0
        assert_same_as_recompute(got, engine.generate(prompt_ids=cut.ids, use_store=False))


def test_with_reuse_the_kept_turns_are_rotated_into_place_not_prefilled(tiny, make_engine):
    probe = make_engine()
    engine = make_engine(context_window=window_for(probe, 3), reuse_after_truncation=True)
    head = len(chat_prompt_ids(tiny.tokenizer, [{"role": "system", "content": SYSTEM}],
                               add_generation_prompt=False))
    history = [{"role": "system", "content": SYSTEM}]
    moved = moved_again = direct_hits = 0
    prev = None
    # Long questions push turns out; a short follow-up often fits after the same cut.
    for question in [q for pair in zip(QUESTIONS[:6], ["Thanks."] * 6) for q in pair]:
        history.append({"role": "user", "content": question})
        cut = truncate(history, engine.prompt_ids, engine.context_window, 8)
        direct = engine.store.lookup(cut.ids[:-1]).hit_tokens
        with prefill_lengths(tiny.model) as seen:
            got = engine.generate(history)
        engine.wait_for_saves()
        history.append({"role": "assistant", "content": got.text})
        prev, saved = got, saved_tokens(prev) // C * C if prev else 0
        if not got.dropped_turns:
            assert got.shifted_tokens == 0
            continue
        # Every truncated turn re-uses what the turn before saved: moved, or under its own keys
        # when this turn drops the same turns as that one did.
        assert seen[0] == got.prompt_tokens - got.hit_tokens  # only the rest is prefilled
        assert got.hit_tokens >= saved - got.dropped_tokens
        if got.shifted_tokens:
            assert got.hit_tokens == head + got.shifted_tokens > direct
            moved += got.dropped_turns == 1
            moved_again += got.dropped_turns > 1  # from what a truncated turn saved
        else:
            assert got.hit_tokens == direct > head
            direct_hits += 1
        assert got.tier_tokens == {"host": got.hit_tokens}
    assert moved == 1 and moved_again >= 1 and direct_hits >= 1


def kl_per_step(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) of each step's next-token distribution."""
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


@pytest.fixture(scope="module")
def sharp(tmp_path_factory) -> Tiny:
    """A tiny Llama whose weights are large enough for attention to be peaked (the default
    model's is nearly uniform, so positions barely matter to it and rotating is hardly tested)."""
    return build(tmp_path_factory.mktemp("sharp"), initializer_range=0.2)


def build(path: Path, **config: object) -> Tiny:
    tokenizer = build_tokenizer()
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            **{**shape, **config},
        ))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attention.NAME
    )
    return Tiny(path, model, tokenizer)


def reuse_agreement(model: Tiny, history: list[dict[str, str]], window: int
                    ) -> tuple[float, float, int]:
    """Mean KL and top-1 agreement over 16 steps between re-use and recompute after the
    truncation of ``history``'s last turn (teacher-forced on the recompute's tokens), and the
    tokens moved. A fresh store holds what the previous turn saved."""
    engine = HFEngine(model.path, model.store(256), EngineConfig(
        max_new_tokens=16, context_window=window, reuse_after_truncation=True, async_save=False,
    ), model=model.model, tokenizer=model.tokenizer)
    try:
        assert engine.generate(history[:-2]).dropped_turns == 0  # the previous turn
        ref = engine.generate(history, use_store=False)
        ref = engine.generate(history, use_store=False, forced_tokens=ref.token_ids)
        got = engine.generate(history, forced_tokens=ref.token_ids)
        assert got.dropped_turns == 1
        kl = float(kl_per_step(ref.step_logits, got.step_logits).mean())
        top1 = float((got.step_logits.argmax(-1) == torch.tensor(ref.token_ids)).float().mean())
        return kl, top1, got.shifted_tokens
    finally:
        engine.close()


def test_reused_kv_agrees_with_a_recompute_and_rotating_it_is_what_makes_it_agree(sharp, monkeypatch):
    big = HFEngine(sharp.path, None, EngineConfig(max_new_tokens=30),
                   model=sharp.model, tokenizer=sharp.tokenizer)
    history = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS[:5]:  # the model's own replies, so the previous turn's KV hits
        history.append({"role": "user", "content": question})
        history.append({"role": "assistant", "content": big.generate(history).text})
    history.append({"role": "user", "content": QUESTIONS[5]})
    window = len(big.prompt_ids(history)) - 20  # the first question has to go

    kl, top1, moved = reuse_agreement(sharp, history, window)
    # The fault: keys re-used where they were cached, not rotated.
    monkeypatch.setattr(RotaryShift, "shift_keys", lambda self, keys, delta: keys.clone())
    kl_unrotated, top1_unrotated, moved_again = reuse_agreement(sharp, history, window)

    assert moved == moved_again > 200
    # Measured: KL 0.02 nats rotated, 0.68 unrotated (top-1 1.0 vs 0.5). The rotated KV differs
    # from a recompute only through the dropped turn's influence on the kept ones; a missing,
    # wrong-signed or wrong-frequency rotation costs an order of magnitude more.
    assert kl < 0.15 and top1 >= 0.75
    assert kl < kl_unrotated / 5 and top1 > top1_unrotated


def test_with_one_layer_moved_kv_is_exact_so_only_the_approximation_differs(tmp_path):
    """A one-layer model's keys and values depend on their own token only (no earlier layer
    mixed the context in), so moved KV is the KV of the truncated prompt: everything but the
    approximation (which chunks, which offsets, the rotation) is checked exactly."""
    model = build(tmp_path, num_hidden_layers=1, initializer_range=0.2)
    engine = HFEngine(model.path, model.store(256), EngineConfig(
        max_new_tokens=8, reuse_after_truncation=True, context_window=window_for_chat(model, 2),
    ), model=model.model, tokenizer=model.tokenizer)
    try:
        chat = fixed_chat(4)
        engine.generate(chat[:-2])  # the previous turn saves the chat as it was
        engine.wait_for_saves()
        got = engine.generate(chat)
        assert got.dropped_turns == 2 and got.shifted_tokens > 4 * C
        ids = truncate(chat, engine.prompt_ids, engine.context_window, 8).ids
        assert_same_as_recompute(got, engine.generate(prompt_ids=ids, use_store=False))
    finally:
        engine.close()


def test_a_model_whose_rope_cannot_be_shifted_recomputes_and_says_why(tmp_path, caplog):
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = build(tmp_path, rope_parameters=dynamic)
    engine = HFEngine(model.path, model.store(256), EngineConfig(
        max_new_tokens=8, reuse_after_truncation=True, context_window=window_for_chat(model, 2),
    ), model=model.model, tokenizer=model.tokenizer)
    try:
        assert "re-use after truncation is off for this model: rope_type 'dynamic'" in caplog.text
        assert_overflow_recomputed(engine, caplog, "recomputing, its cached KV cannot be moved: rope_type 'dynamic'")
    finally:
        engine.close()


def assert_overflow_recomputed(engine: HFEngine, caplog, why: str) -> None:
    """Two turns saved, then a four-turn chat that overflows the window: the turn is recomputed
    (nothing shifted, ``why`` logged) and its output is a recompute's of the truncated prompt."""
    chat = fixed_chat(4)
    engine.generate(chat[:-2])
    engine.wait_for_saves()
    got = engine.generate(chat)
    assert got.dropped_turns > 0 and got.shifted_tokens == 0
    assert why in caplog.text
    ids = truncate(chat, engine.prompt_ids, engine.context_window, 8).ids
    assert_same_as_recompute(got, engine.generate(prompt_ids=ids, use_store=False))


def window_for_chat(model: Tiny, turns: int) -> int:
    return len(chat_prompt_ids(model.tokenizer, fixed_chat(turns))) + 8


def test_a_template_that_renders_by_position_is_caught_and_the_turn_recomputed(tiny, caplog):
    """Numbered messages: the kept turns' tokens change when the turns before them go, so the
    cached tokens are not the prompt's and must not be re-used."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE.replace("message['role'] + '", "message['role'] + "
                                                    "(loop.index | string) + '")
    engine = HFEngine(tiny.path, tiny.store(256), EngineConfig(
        max_new_tokens=8, reuse_after_truncation=True,
        context_window=len(chat_prompt_ids(tokenizer, fixed_chat(2))) + 8,
    ), model=tiny.model, tokenizer=tokenizer)
    try:
        assert "user2<" in tokenizer.decode(engine.prompt_ids(fixed_chat(4)))  # numbered
        assert_overflow_recomputed(engine, caplog, "not the system prompt's followed by the kept turns'")
    finally:
        engine.close()


def test_a_damaged_source_chunk_costs_a_retry_and_the_turn_is_recomputed_exactly(
    make_engine, tmp_path
):
    ssd = tmp_path / "ssd"
    probe = make_engine()
    engine = make_engine(host_chunks=2, disk_path=ssd, context_window=window_for(probe, 3),
                         reuse_after_truncation=True)
    chat = fixed_chat(4)
    engine.generate(chat[:-2])  # the previous turn saves the chat as it was
    engine.wait_for_saves()
    source = engine.store.lookup(engine.prompt_ids(chat)[:-1])
    bad = len(source.keys) - 3
    assert source.tiers[bad] == "disk"
    chunk_file(ssd, source.keys[bad]).unlink()  # a kept chunk, on SSD only

    got = engine.generate(chat)
    assert (got.retries, got.shifted_tokens) == (1, 0) and got.dropped_turns > 0
    ids = truncate(chat, engine.prompt_ids, engine.context_window, 8).ids
    assert_same_as_recompute(got, engine.generate(prompt_ids=ids, use_store=False))


def test_engine_config_and_raw_prompts_are_checked(tiny, make_engine):
    with pytest.raises(ValueError, match="context_window must be positive"):
        EngineConfig(context_window=0)
    with pytest.raises(ValueError, match="truncation_headroom"):
        EngineConfig(truncation_headroom=-1)
    too_long = "exceeds the model's max_position_embeddings 16384"
    with tiny.store(4) as store, pytest.raises(ValueError, match=too_long):
        HFEngine(tiny.path, store, EngineConfig(context_window=16385),
                 model=tiny.model, tokenizer=tiny.tokenizer)
    assert make_engine().context_window == 16384  # the model's, by default
    engine = make_engine(context_window=100, truncation_headroom=10)
    with pytest.raises(ValueError, match="raw prompt ids are not truncated"):
        engine.generate(prompt_ids=list(range(10, 101)), max_new_tokens=2)
    assert engine.generate(prompt_ids=list(range(10, 100)), max_new_tokens=2).prompt_tokens == 90
