"""rlt-bench greedy: are a model's greedy continuations of six fixed Python prompts valid Python?

Each prompt (a `def`, a `class`, an `import` block, a `for` loop, an `if` chain, a docstring) is
continued for 96 tokens at temperature 0 through the engine. The prompt plus its continuation,
cut at its last complete line (the whole text when the model ended it with <eos>), must pass
`ast.parse`, and no continuation may be only whitespace. The cut must keep some code of the
continuation: one that completes no line with code in it (the cut would leave the prompt alone,
or nothing) is not valid. The target (issue 20): at least 4 of 6 valid and none only whitespace;
the exit status is 0 when it is met, 1 otherwise.

    rlt-bench greedy                       # tiny-ouro-py on the CPU (or cuda if available)
    rlt-bench greedy --model DIR --device cpu
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.messages import SamplingParams

# Each ends where a token boundary of the training text falls (no trailing space or newline).
PROMPTS: tuple[str, ...] = (
    "def fibonacci(n):",
    "class Stack:",
    "import os\nimport sys",
    "for name in names:",
    "if x < 0:\n    sign = -1\nelif x == 0:\n    sign = 0\nelse:",
    'def parse(text):\n    """Split *text* into a list of tokens.',
)
MAX_TOKENS = 96
MIN_VALID = 4


@dataclass(frozen=True)
class Verdict:
    prompt: str
    continuation: str
    ended: bool  # the model ended the text (<eos>) before MAX_TOKENS
    error: str | None  # None: valid Python

    @property
    def is_valid(self) -> bool:
        return self.error is None


def checked_text(prompt: str, continuation: str, ended: bool) -> str:
    """prompt + continuation, cut after its last newline unless the model ended the text."""
    text = prompt + continuation
    return text if ended else text[: text.rfind("\n") + 1]


def judge(prompt: str, continuation: str, ended: bool) -> Verdict:
    """Whether the continuation is non-blank and the checked text parses (the parser's message if not)."""
    if not continuation.strip():
        return Verdict(prompt, continuation, ended, "only whitespace")
    text = checked_text(prompt, continuation, ended)
    if len(text) < len(prompt) or not text[len(prompt):].strip():
        return Verdict(prompt, continuation, ended, "no complete line of code")
    try:
        ast.parse(text)
    except SyntaxError as exc:
        return Verdict(prompt, continuation, ended, f"{exc.msg} (line {exc.lineno})")
    return Verdict(prompt, continuation, ended, None)


def meets_target(verdicts: Sequence[Verdict]) -> bool:
    """At least MIN_VALID valid and none only whitespace."""
    return (sum(v.is_valid for v in verdicts) >= MIN_VALID
            and not any(v.error == "only whitespace" for v in verdicts))


def continue_prompts(llm, max_tokens: int = MAX_TOKENS) -> list[Verdict]:
    """Greedy continuations of PROMPTS through the engine, judged."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    return [judge(p, o.text, o.finish_reason == "stop") for p, o in zip(PROMPTS, outputs, strict=True)]


def report(verdicts: Sequence[Verdict]) -> str:
    """Each prompt and continuation, its verdict, and the summary line."""
    lines = []
    for i, v in enumerate(verdicts, 1):
        lines += [f"--- {i}: {'valid' if v.is_valid else 'INVALID: ' + v.error}{' (ended)' if v.ended else ''}",
                  v.prompt + v.continuation]
    valid = sum(v.is_valid for v in verdicts)
    lines.append(f"=== {valid} of {len(verdicts)} valid; target ≥ {MIN_VALID} and none only whitespace: "
                 f"{'met' if meets_target(verdicts) else 'NOT met'}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlt-bench greedy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-ouro-py")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from rlt_engine.llm import LLM

    args = parse_args(argv)
    with LLM(args.model, workers=0, device=args.device, dtype=args.dtype) as llm:
        verdicts = continue_prompts(llm, args.max_tokens)
    print(report(verdicts))
    return 0 if meets_target(verdicts) else 1
