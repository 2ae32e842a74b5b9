"""One order for the dotted names that ranks hold parts of: the unsplit model's (`export`'s full
state dicts list their entries in it, as one process's `state_dict()` does).
"""

from __future__ import annotations

__all__ = ["tree_order"]


def tree_order(name_lists: list[list[str]]) -> list[str]:
    """One order for dotted names listed per rank, as the unsplit model lists them.

    Each list is in its module's order (a rank holds parts of the tree; with several stages per
    rank, not contiguous ones). Siblings keep the order the lists give them (merged where lists
    overlap); numbered siblings (a `ModuleList`'s blocks) go in numeric order.
    """
    names = {name for names in name_lists for name in names}
    children: dict[str, list[str]] = {}
    for names_of_rank in name_lists:
        seen: dict[str, list[str]] = {}
        for name in names_of_rank:
            parts = name.split(".")
            for depth in range(len(parts)):
                siblings = seen.setdefault(".".join(parts[:depth]), [])
                if parts[depth] not in siblings:
                    siblings.append(parts[depth])
        for parent, siblings in seen.items():
            _merge_sequence(children.setdefault(parent, []), siblings)
    out: list[str] = []

    def walk(parent: str) -> None:
        kids = children.get(parent, [])
        if kids and all(k.isdigit() for k in kids):
            kids = sorted(kids, key=int)
        for kid in kids:
            path = f"{parent}.{kid}" if parent else kid
            if path in names:
                out.append(path)
            walk(path)

    walk("")
    return out


def _merge_sequence(merged: list[str], sequence: list[str]) -> None:
    """Insert `sequence`'s new items into `merged` right after their predecessor in `sequence`."""
    at = 0
    for item in sequence:
        if item in merged:
            at = merged.index(item) + 1
        else:
            merged.insert(at, item)
            at += 1
