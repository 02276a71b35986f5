"""Routing rows by their ``domain`` tag to named config entries: reward domains (``reward.domains``) and
distillation teachers (``distill.teachers``) share the rule and its checks.

An entry takes the rows whose tag is in its ``tags``, or equals its name where it lists none; a tag no
entry takes goes to the section's default entry, if one is set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def entry_tags(entries: Mapping[str, Sequence[str] | None]) -> dict[str, list[str]]:
    """Each entry's tags: its ``tags``, or its name where it lists none."""
    return {name: list(tags or [name]) for name, tags in entries.items()}


def tag_owners(entries: Mapping[str, Sequence[str] | None]) -> dict[str, str]:
    """``{tag: entry}`` over every entry's tags (a tag two entries take: the later one)."""
    return {tag: name for name, tags in entry_tags(entries).items() for tag in tags}


def route_tag(entries: Mapping[str, Sequence[str] | None], tag: str, default: str | None) -> str | None:
    """The entry a row tagged ``tag`` goes to; ``default`` where none takes it (None: nowhere)."""
    for name, tags in entry_tags(entries).items():
        if tag in tags:
            return name
    return default


def tag_problems(
    entries: Mapping[str, Sequence[str] | None], default: str | None, section: str, default_key: str
) -> list[tuple[str, str]]:
    """``(dotted path, reason)``: a tag two entries take, and a default that names no entry.
    ``section``: the entries' key (``reward.domains``); ``default_key``: the default's."""
    problems, seen = [], {}
    for name, tags in entry_tags(entries).items():
        for tag in tags:
            if tag in seen:
                problems.append((f"{section}.{name}.tags", f"tag {tag!r} is also routed to {seen[tag]!r}"))
            seen[tag] = name
    if default is not None and default not in entries:
        problems.append(
            (default_key, f"{default!r} is not one of the {section.rsplit('.', 1)[-1]} {sorted(entries)}")
        )
    return problems
