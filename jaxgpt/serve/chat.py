"""Chat templates: a conversation (a list of role/content messages) to the one prompt text a model continues.

A template is a Jinja2 string in the Hugging Face format: it sees `messages`, `add_generation_prompt`,
`bos_token` and `eos_token`, and may call `raise_exception(message)` to refuse a conversation. It renders in
jinja2's sandbox with trim_blocks and lstrip_blocks, as transformers renders `apply_chat_template`, so a
template written for either renders the same text in both. A run keeps its template in the file
`chat_template.jinja` of its workdir (a local directory or a bucket); `jaxgpt serve --chat_template FILE`
gives another. The text is then encoded with the run's tokenizer like any prompt.
"""

from __future__ import annotations

import os

from jaxgpt import storage
from jaxgpt.data.conversations import TEMPLATE_FILE, ChatTemplate
from jaxgpt.errors import UserError

# ChatTemplate (the rendering) and TEMPLATE_FILE are defined once, with the chat format in
# jaxgpt.data.conversations, which fine-tuning uses too; the server and its command import them from here.
__all__ = ["TEMPLATE_FILE", "ChatTemplate", "load_template"]


def load_template(workdir: str | os.PathLike[str] | None, override: str | os.PathLike[str] | None
                  ) -> str | None:
    """The template text of `override` (a file), else the run's `chat_template.jinja`, else None (no chat)."""
    if override is not None:
        path = storage.location(override, "--chat_template")
    elif workdir is not None:
        path = storage.location(workdir, "--workdir") / TEMPLATE_FILE
        with storage.guard(path, "looking for the run's chat template"):
            if not path.exists():
                return None
    else:
        return None
    with storage.guard(path, "reading the chat template"):
        if not path.exists():
            raise UserError(f"--chat_template={override}: no such file")
        return path.read_text(encoding="utf-8")
