"""Tool rules that force a call and allow no tool (SPEC §8): found before a run, from the rule
books of its agent and its request, not found at run time as a step offered no tool."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from proxy.engine.policies.tool_rules import RuleBook

# The (tool, output) pairs `dead_ends` weighs at most: past it, the rest is left to the run (a
# step its rules leave no tool is sent with none).
MAX_DEAD_END_CHECKS = 20_000


def dead_ends(books: Sequence[RuleBook], enabled: Iterable[str]) -> list[tuple[str, str]]:
    """Where the rules force a call and leave no tool to call (SPEC §8: a configuration error,
    never a step offered no tool): after a tool, for one of its outputs the conditional rules
    tell apart (or any other), what the books allow intersect empty. Each problem names the rule
    of the last book that forces the call. (The first step is `run_first`'s, checked alone.)"""
    names = frozenset(enabled)
    limits = [_StepLimits(book) for book in books]
    exits = frozenset().union(*(book.exit_tools for book in books))
    problems: list[tuple[str, str]] = []
    budget = MAX_DEAD_END_CHECKS
    for last in sorted(frozenset().union(*(lim.ruled for lim in limits)) - exits):
        outputs: set[str] = set()
        for lim in limits:
            if last in lim.conditional:
                outputs.update(lim.conditional[last].child_output_mapping)
        for output in [None, *sorted(outputs)]:  # None: an output no rule maps
            budget -= 1
            if budget < 0:
                return problems
            after = [lim.after(last, output) for lim in limits]
            forcing = [path for _, path in after if path is not None]
            if not forcing:
                continue
            candidates = min((kept for kept, _ in after if kept is not None), key=len)
            if not any(
                name in names
                and all(
                    (kept is None or name in kept) and lim.may_follow(name, last)
                    for lim, (kept, _) in zip(limits, after, strict=True)
                )
                for name in candidates
            ):
                gives = "an output no rule maps" if output is None else f"the output {output!r}"
                problems.append(
                    (
                        forcing[-1],
                        f"once {last!r} gives {gives}, the tool rules force a call and allow "
                        "no tool (their children, conditional picks and parents have none in "
                        "common)",
                    )
                )
                break
    return problems


class _StepLimits:
    """What one book's rules make of the step after a tool, looked up as `dead_ends` asks."""

    def __init__(self, book: RuleBook) -> None:
        self.children = book.children_of("constrain_child_tools")
        self.paths: dict[str, str] = {}
        for rule in book.of("constrain_child_tools"):
            self.paths.setdefault(rule.tool_name, f"{rule.path}.children")
        self.conditional = {r.tool_name: r for r in book.of("conditional")}  # the run's: the last
        self.parents: dict[str, set[str]] = {}
        for parent, kids in book.children_of("parent_last_tool").items():
            for kid in kids:
                self.parents.setdefault(kid, set()).add(parent)
        self.ruled = set(self.children) | set(self.conditional)

    def may_follow(self, name: str, last: str) -> bool:
        return self.parents.get(name, set()) <= {last}

    def after(self, last: str, output: str | None) -> tuple[frozenset[str] | None, str | None]:
        """The tools the step after `last` (which gave `output`; None: one its conditional
        rule does not map) is kept to (None: any), and the path of the rule that forces a call
        then (None: none does)."""
        kept, forcing = self.children.get(last), self.paths.get(last)
        rule = self.conditional.get(last)
        if rule is None:
            return kept, forcing
        if output is not None and output in rule.child_output_mapping:
            picked = frozenset({rule.child_output_mapping[output]})
        elif rule.default_child is not None:
            picked = frozenset({rule.default_child})
        elif rule.require_output_mapping:
            picked = frozenset(rule.child_output_mapping.values())
        else:
            return kept, forcing
        return (picked if kept is None else kept & picked), forcing or rule.path
