"""What a supervisor should notice before approving a call, read from the run itself.

Three flags, each a plain sentence naming the step it comes from:
- calls denied earlier in this run (a model that asked for a tool nobody granted, say after a
  prompt injection, is a model whose next request deserves a second look);
- tool results whose text reads like instructions to the model (the injection itself);
- money arguments whose number appears in none of the results the run has read (the amount the
  model proposes disagrees with what the provider said).
They inform a decision; they never make one (the gateway and the policy decide, DESIGN.md 6).
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation

from runs.models import Step, StepKind, StepStatus
from tools.display import formatted_arguments, money_arguments

INSTRUCTION_LIKE = re.compile(
    r"ignore (?:all |any )?(?:the )?(?:previous|prior|above|earlier) instructions"
    r"|disregard (?:all |any |the )?(?:previous|prior|above|earlier|your)"
    r"|system override|new instructions\s*:|you are now|you must now"
    r"|(?:call|use|invoke) (?:the )?\w*(?:transfer|delete|refund|send)\w* (?:tool|with)",
    re.IGNORECASE,
)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
QUOTE_AROUND = 60  # characters of the result shown either side of the instruction-like text


def _text_of(result) -> str:
    if result is None:
        return ""
    if isinstance(result, dict) and isinstance(result.get("text"), str):
        return result["text"]
    return json.dumps(result, ensure_ascii=False)


def _numbers(text: str) -> set[Decimal]:
    found = set()
    for match in NUMBER.findall(text):
        try:
            found.add(Decimal(match.replace(",", "")))
        except InvalidOperation:
            continue
    return found


def risk_flags(approval) -> list[dict]:
    """Each flag: {"kind", "text", "seq"} in the order of the steps they come from."""
    earlier = list(
        Step.objects.filter(run_id=approval.run_id, kind=StepKind.TOOL, seq__lt=approval.step.seq).order_by(
            "seq"
        )
    )
    flags: list[dict] = []
    for step in earlier:
        if step.status == StepStatus.DENIED:
            denied_arguments = ", ".join(
                f"{name} {text}" for name, (text, _) in formatted_arguments(step.tool, step.arguments).items()
            )
            flags.append(
                {
                    "kind": "denied",
                    "seq": step.seq,
                    "text": f"Earlier in this run the model asked for {step.tool_name}"
                    f"{f' ({denied_arguments})' if denied_arguments else ''} and was denied: {step.error or step.observation}",
                }
            )
        text = _text_of(step.result)
        match = INSTRUCTION_LIKE.search(text)
        if match:
            start, end = max(match.start() - QUOTE_AROUND, 0), min(match.end() + QUOTE_AROUND, len(text))
            quote = ("…" if start else "") + text[start:end] + ("…" if end < len(text) else "")
            flags.append(
                {
                    "kind": "instructions",
                    "seq": step.seq,
                    "text": f"The result of {step.tool_name} contains text that reads "
                    f"like instructions to the model: “{quote}”",
                }
            )
    read = set()
    for step in earlier:
        if step.status in (StepStatus.SUCCEEDED, StepStatus.RESOLVED_SUCCEEDED):
            read |= _numbers(_text_of(step.result))
    arguments = approval.arguments if isinstance(approval.arguments, dict) else {}
    readable = formatted_arguments(approval.tool, arguments)
    for name in money_arguments(approval.tool):
        value = arguments.get(name)
        try:
            number = Decimal(str(value))
        except (InvalidOperation, ValueError):
            continue
        if read and number.is_finite() and number not in read:
            flags.append(
                {
                    "kind": "disagrees",
                    "seq": approval.step.seq,
                    "text": f"{name} {readable[name][0]} appears in none of the results this run has read",
                }
            )
    return flags
