"""Chats rendered to token ids with a model's own chat template: :func:`chat_prompt_ids` for
the engines, and :class:`ChatRenderer` for the store daemon's HTTP lookup
(:mod:`kvtier.server.http` takes it from the CLI: the server imports no engine).

    render = ChatRenderer()
    ids = render("/models/llama", [{"role": "user", "content": "hi"}])

A tokenizer is loaded from local files only, never with the model's own code
(``trust_remote_code`` off); the last few are kept. transformers renders templates in a
sandboxed Jinja environment. The caller decides which directories it trusts and serializes
calls (a chat template holds the GIL).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from kvtier.engines.truncation import Message


def chat_prompt_ids(  # type: ignore[no-untyped-def]
    tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's template (and a generation prompt)."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)
    if hasattr(ids, "keys"):  # a BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return list(ids)


class TokenizerError(LookupError):
    """No tokenizer could be loaded from the model's files."""


class NoChatTemplate(ValueError):
    """The model's tokenizer has no chat template."""


class ChatRenderer:
    def __init__(self, keep: int = 4) -> None:
        self._load = functools.lru_cache(maxsize=keep)(self._tokenizer)

    def __call__(self, path: str, messages: list[dict[str, str]]) -> list[int]:
        tokenizer = self._load(path)
        if not getattr(tokenizer, "chat_template", None):
            raise NoChatTemplate("its tokenizer has no chat template: send tokens instead")
        return [int(t) for t in chat_prompt_ids(tokenizer, messages, add_generation_prompt=True)]  # type: ignore[arg-type]

    @staticmethod
    def _tokenizer(path: str) -> object:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception:  # noqa: BLE001 - missing or damaged files, an unknown class
            raise TokenizerError("cannot load a tokenizer from that model's files") from None


__all__ = ["ChatRenderer", "NoChatTemplate", "TokenizerError", "chat_prompt_ids"]
