"""Config keys renamed since runs were saved: old config files, command lines and saved runs still load.

- `chat.tasks` is `chat.datasets` (the built-in conversations are datasets; a task is what the loop trains): the old
  key stays in the schema as an alias of the new one (one value, either name sets it), left out of the typed config.
- RL's prompts moved from `config.chat` to `config.rl` (`data`, `datasets`, `examples`, `val_fraction`): a run of
  task rl whose config sets them under chat only, as configs did before, reads them from there and says so once;
  a run saved before the move resumes against the chat settings it saved (`saved_rl_settings`).
tests/integration/test_legacy_runs.py resumes and samples runs saved before these renames.
"""

from __future__ import annotations

import sys
from typing import Any

from ml_collections import ConfigDict

ALIASES = {"chat": {"tasks": "datasets"}}  # group -> {old key: new key}
RL_PROMPT_KEYS = ("data", "datasets", "examples", "val_fraction")


def add_aliases(c: ConfigDict) -> None:
    """Each old key of `ALIASES` as a reference to its new key's value, so that setting either sets both."""
    for group, names in ALIASES.items():
        for old, new in names.items():
            c[group][old] = c[group].get_ref(new)


def drop_aliases(values: dict[str, Any]) -> None:
    """The old keys out of a ConfigDict's values (their values are the new keys')."""
    for group, names in ALIASES.items():
        for old in names:
            values.get(group, {}).pop(old, None)


def rl_prompts_from_chat(c: ConfigDict, defaults: ConfigDict) -> None:
    """For task rl: each prompt key set under chat (not at its default) while rl's is at its default moves to rl."""
    if c.task != "rl":
        return
    moved = [k for k in RL_PROMPT_KEYS if c.chat[k] != defaults.chat[k] and c.rl[k] == defaults.rl[k]]
    for key in moved:
        c.rl[key] = c.chat[key]
    if moved:
        print(f"warning: RL's prompts are configured under config.rl now: read config.chat.{{{','.join(moved)}}} as "
              f"config.rl.{{{','.join(moved)}}} (set those instead)", file=sys.stderr)


def saved_rl_settings(saved_meta: dict[str, Any]) -> dict[str, Any]:
    """An RL checkpoint's trajectory settings (meta["rl"]["settings"]); for a run saved before the move, with the
    prompt settings it read from its config's chat group (under their old names there)."""
    saved = dict(saved_meta.get("rl", {}).get("settings", {}))
    chat = saved_meta.get("config", {}).get("chat", {})
    old_names = {new: old for old, new in ALIASES["chat"].items()}
    for key in RL_PROMPT_KEYS:
        if key not in saved and old_names.get(key, key) in chat:
            saved[key] = chat[old_names.get(key, key)]
    return saved
