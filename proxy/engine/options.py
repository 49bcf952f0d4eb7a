"""The policy options as one typed schema (SPEC §6 to §9), shared by agents in the config file
and by a request's `loop` object.

This module checks shapes only: types, bounds and the rules inside one entry. What an option
refers to (tools, named conditions, prices) and CEL expressions are checked when a policy is
compiled (`proxy.engine.policy`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StringConstraints,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from proxy.engine.expressions.lexer import MAX_EXPR_CHARS

# Counts are at most a signed 64-bit integer: what a state backend stores (sqlite's INTEGER).
MAX_COUNT = 2**63 - 1
PositiveInt = Annotated[int, Field(ge=1, le=MAX_COUNT, strict=True)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT, strict=True)]
PositiveNumber = Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)]
MAX_NAME_CHARS = 256  # names of models, agents, tools, threads and contexts
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]
# What a name that is stored, logged or put on spans may not hold: control characters, line
# and paragraph separators, and the marks that turn the direction of the text around them (a
# log line or a label read backwards).
UNSAFE_IN_NAMES = r"\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
# A name stored, logged and put on spans (a thread's, a stop condition's `id`): nothing unsafe.
SafeName = Annotated[Name, Field(pattern=f"^[^{UNSAFE_IN_NAMES}]+$")]
NonEmptyNames = Annotated[list[Name], Field(min_length=1, max_length=256)]

DEFAULT_NUDGE = (
    "You are currently in an autonomous execution mode with no user interaction. "
    "You must complete your task by calling one of the terminating tools."
)
# Nesting of `any` / `all` / `not` in one stop condition: deeper trees are refused before they
# are walked.
MAX_CONDITION_DEPTH = 16
MAX_ENTRIES = 256  # stop conditions, rules and limits per list
MAX_CONDITIONS = 1024  # the conditions of one `stop_when`, however nested


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- stop conditions (SPEC §6) ------------------------------------------------------------------


class _Condition(Options):
    id: SafeName | None = None


class StepCountIs(_Condition):
    step_count_is: PositiveInt


class HasToolCall(_Condition):
    has_tool_call: NonEmptyNames  # one name, or a list of names

    @field_validator("has_tool_call", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class MaxTokensUsed(_Condition):
    max_tokens_used: PositiveInt


class MaxCost(_Condition):
    max_cost: PositiveNumber


class FinishReasonIs(_Condition):
    finish_reason_is: Name


class MaxDuration(_Condition):
    max_duration_s: PositiveNumber


class AnyOf(_Condition):
    any: Annotated[list[ConditionOptions], Field(min_length=1, max_length=MAX_ENTRIES)]


class AllOf(_Condition):
    all: Annotated[list[ConditionOptions], Field(min_length=1, max_length=MAX_ENTRIES)]


class NotOf(_Condition):
    model_config = ConfigDict(populate_by_name=True)
    not_: ConditionOptions = Field(alias="not")


class Expr(_Condition):
    expr: Annotated[str, StringConstraints(min_length=1, max_length=MAX_EXPR_CHARS)]


class Webhook(_Condition):
    webhook: Name


class PythonCheck(_Condition):
    python: Name


class _UnknownCondition(_Condition):
    """Stands for an entry with no known kind: every key is reported as unknown."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _one_kind(self) -> _UnknownCondition:
        raise PydanticCustomError("condition_kind", "a stop condition has exactly one kind")


CONDITION_KINDS: dict[str, type[_Condition]] = {
    "step_count_is": StepCountIs,
    "has_tool_call": HasToolCall,
    "max_tokens_used": MaxTokensUsed,
    "max_cost": MaxCost,
    "finish_reason_is": FinishReasonIs,
    "max_duration_s": MaxDuration,
    "any": AnyOf,
    "all": AllOf,
    "not": NotOf,
    "expr": Expr,
    "webhook": Webhook,
    "python": PythonCheck,
}
CONDITION_TAG = "condition:"


def _condition_kind(value: Any) -> str | None:
    if isinstance(value, _Condition):
        return CONDITION_TAG + kind_of(value)
    if not isinstance(value, dict):
        return None
    for key in value:
        if isinstance(key, str) and key in CONDITION_KINDS:
            return CONDITION_TAG + key
    return CONDITION_TAG + "unknown"


ConditionOptions = Annotated[
    Annotated[StepCountIs, Tag(CONDITION_TAG + "step_count_is")]
    | Annotated[HasToolCall, Tag(CONDITION_TAG + "has_tool_call")]
    | Annotated[MaxTokensUsed, Tag(CONDITION_TAG + "max_tokens_used")]
    | Annotated[MaxCost, Tag(CONDITION_TAG + "max_cost")]
    | Annotated[FinishReasonIs, Tag(CONDITION_TAG + "finish_reason_is")]
    | Annotated[MaxDuration, Tag(CONDITION_TAG + "max_duration_s")]
    | Annotated[AnyOf, Tag(CONDITION_TAG + "any")]
    | Annotated[AllOf, Tag(CONDITION_TAG + "all")]
    | Annotated[NotOf, Tag(CONDITION_TAG + "not")]
    | Annotated[Expr, Tag(CONDITION_TAG + "expr")]
    | Annotated[Webhook, Tag(CONDITION_TAG + "webhook")]
    | Annotated[PythonCheck, Tag(CONDITION_TAG + "python")]
    | Annotated[_UnknownCondition, Tag(CONDITION_TAG + "unknown")],
    Discriminator(
        _condition_kind,
        custom_error_type="condition_type",
        custom_error_message="a stop condition must be an object",
    ),
]


def kind_of(condition: _Condition) -> str:
    """The condition's kind: the key that names it in JSON."""
    for kind, model in CONDITION_KINDS.items():
        if type(condition) is model:
            return kind
    raise TypeError(f"not a stop condition: {condition!r}")


# -- terminating config (SPEC §7.2) -------------------------------------------------------------


class TerminatingOptions(Options):
    tool_ids: NonEmptyNames
    consecutive_nudges: Count = 1
    nudge_message: Annotated[str, StringConstraints(min_length=1, max_length=8192)] = DEFAULT_NUDGE
    max_invocations: PositiveInt = 64

    @field_validator("nudge_message")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise PydanticCustomError("blank", "must be a non-empty string")
        return value


# -- tool rules (SPEC §8, after Letta) ----------------------------------------------------------

# Letta's class names, accepted as `type` aliases.
RULE_ALIASES = {
    "InitToolRule": "run_first",
    "TerminalToolRule": "exit_loop",
    "ContinueToolRule": "continue_loop",
    "ChildToolRule": "constrain_child_tools",
    "ParentToolRule": "parent_last_tool",
    "ConditionalToolRule": "conditional",
    "MaxCountPerStepToolRule": "max_count_per_step",
    "RequiredBeforeExitToolRule": "required_before_exit",
}
RULE_TAG = "rule:"


class _Rule(Options):
    type: str
    tool_name: Name

    @field_validator("type")
    @classmethod
    def _canonical(cls, value: str) -> str:
        return RULE_ALIASES.get(value, value)


class RunFirst(_Rule):
    type: Literal["run_first", "InitToolRule"]


class ExitLoop(_Rule):
    type: Literal["exit_loop", "TerminalToolRule"]


class ContinueLoop(_Rule):
    type: Literal["continue_loop", "ContinueToolRule"]


class ConstrainChildTools(_Rule):
    type: Literal["constrain_child_tools", "ChildToolRule"]
    children: NonEmptyNames


class ParentLastTool(_Rule):
    type: Literal["parent_last_tool", "ParentToolRule"]
    children: NonEmptyNames


# A tool output a `conditional` rule matches (its whole output, compared as it is).
MAX_MATCHED_OUTPUT_CHARS = 4096
MatchedOutput = Annotated[str, StringConstraints(max_length=MAX_MATCHED_OUTPUT_CHARS)]


class Conditional(_Rule):
    type: Literal["conditional", "ConditionalToolRule"]
    child_output_mapping: Annotated[dict[MatchedOutput, Name], Field(min_length=1, max_length=256)]
    default_child: Name | None = None
    require_output_mapping: StrictBool = False


class MaxCountPerStep(_Rule):
    type: Literal["max_count_per_step", "MaxCountPerStepToolRule"]
    max_count_limit: PositiveInt


class RequiredBeforeExit(_Rule):
    type: Literal["required_before_exit", "RequiredBeforeExitToolRule"]


RULE_TYPES = (
    "run_first",
    "exit_loop",
    "continue_loop",
    "constrain_child_tools",
    "parent_last_tool",
    "conditional",
    "max_count_per_step",
    "required_before_exit",
)


def _rule_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    kind = RULE_ALIASES.get(kind, kind)
    return RULE_TAG + kind if kind in RULE_TYPES else None


RuleOptions = Annotated[
    Annotated[RunFirst, Tag(RULE_TAG + "run_first")]
    | Annotated[ExitLoop, Tag(RULE_TAG + "exit_loop")]
    | Annotated[ContinueLoop, Tag(RULE_TAG + "continue_loop")]
    | Annotated[ConstrainChildTools, Tag(RULE_TAG + "constrain_child_tools")]
    | Annotated[ParentLastTool, Tag(RULE_TAG + "parent_last_tool")]
    | Annotated[Conditional, Tag(RULE_TAG + "conditional")]
    | Annotated[MaxCountPerStep, Tag(RULE_TAG + "max_count_per_step")]
    | Annotated[RequiredBeforeExit, Tag(RULE_TAG + "required_before_exit")],
    Discriminator(
        _rule_type,
        custom_error_type="rule_type",
        custom_error_message=f"unknown rule type; expected one of {', '.join(RULE_TYPES)}",
    ),
]


# -- tool call limits (SPEC §9) -----------------------------------------------------------------


class ToolCallLimitOptions(Options):
    tool_name: Name | None = None
    thread_limit: Count | None = None
    run_limit: Count | None = None
    exit_behavior: Literal["continue", "error", "end"] = "continue"

    @field_validator("run_limit")
    @classmethod
    def _within_thread_limit(cls, run: int | None, info: ValidationInfo) -> int | None:
        thread = info.data.get("thread_limit")
        if run is not None and thread is not None and run > thread:
            raise PydanticCustomError(
                "limit_order",
                "run_limit ({run}) cannot be larger than thread_limit ({thread})",
                {"run": run, "thread": thread},
            )
        return run

    @model_validator(mode="after")
    def _some_limit(self) -> ToolCallLimitOptions:
        if self.thread_limit is None and self.run_limit is None:
            raise PydanticCustomError("no_limit", "set run_limit, thread_limit or both")
        return self


# -- a whole policy -----------------------------------------------------------------------------


class PolicyOptions(Options):
    """The loop rules an agent sets, and a request's `loop` adds or tightens (SPEC §4.1)."""

    stop_when: Annotated[list[ConditionOptions], Field(max_length=MAX_ENTRIES)] = []
    terminating_config: TerminatingOptions | None = None
    tool_rules: Annotated[list[RuleOptions], Field(max_length=MAX_ENTRIES)] = []
    tool_call_limits: Annotated[list[ToolCallLimitOptions], Field(max_length=MAX_ENTRIES)] = []
    max_steps: PositiveInt | None = None
    final_answer: StrictBool | None = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("stop_when", mode="before")
    @classmethod
    def _bounded_depth(cls, value: Any) -> Any:
        """Refuses deep `any`/`all`/`not` trees, and more than MAX_CONDITIONS conditions in
        all, before they are validated recursively."""
        seen = 0
        for index, entry in enumerate(value if isinstance(value, list) else []):
            level, depth = [entry], 0
            while level:
                depth += 1
                seen += len(level)
                if depth > MAX_CONDITION_DEPTH:
                    raise PydanticCustomError(
                        "condition_depth",
                        "entry {index} nests any / all / not more than {limit} levels deep",
                        {"index": index, "limit": MAX_CONDITION_DEPTH},
                    )
                if seen > MAX_CONDITIONS:
                    raise PydanticCustomError(
                        "condition_count",
                        "more than {limit} conditions in all (those inside any / all / not "
                        "included)",
                        {"limit": MAX_CONDITIONS},
                    )
                level = [inner for e in level for inner in _children(e)]
        return value


def _children(entry: Any) -> list[Any]:
    if not isinstance(entry, dict):
        return []
    inner = [c for key in ("any", "all") if isinstance(entry.get(key), list) for c in entry[key]]
    return [*inner, entry["not"]] if isinstance(entry.get("not"), dict) else inner
