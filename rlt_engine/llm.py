"""The offline entry point: `LLM(...).generate(prompts, params)` (SPEC §8)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from tqdm import tqdm

from protocol.messages import SamplingParams
from rlt_engine.checkpoints import DEFAULT_MODEL
from rlt_engine.config import EngineConfig
from rlt_engine.engine import LLMEngine
from rlt_engine.output_processor import GenerationOutput

Prompt = str | list[int]


class LLM:
    """An engine plus a batch `generate`; close() (or `with`) stops its workers."""

    _ids = itertools.count()

    def __init__(self, model: str = DEFAULT_MODEL, **options: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **options))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params, strict=True):
            self.engine.add_request(request_id, prompt, p)
        finished: dict[str, GenerationOutput] = {}
        with _Progress(len(prompts), use_tqdm) as progress:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(output)
        return [finished[i] for i in ids]

    def close(self) -> None:
        """Stop the engine's workers (idempotent)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Progress:
    """A tqdm bar over finished requests showing output tokens/s and mean loops per token."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = tqdm(total=total, desc="generate", unit="req", disable=not enabled)
        self._start = time.perf_counter()
        self._tokens = 0
        self._loops = 0

    def update(self, output: GenerationOutput) -> None:
        self._tokens += len(output.token_ids)
        self._loops += sum(output.exit_depths)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix(
            {"tok/s": f"{self._tokens / elapsed:.1f}", "loops/tok": f"{self._loops / max(self._tokens, 1):.2f}"},
            refresh=False,
        )
        self._bar.update(1)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()
