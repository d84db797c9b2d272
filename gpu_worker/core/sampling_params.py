"""Per-request sampling parameters, vLLM-shaped, with validation that names the bad field."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_BEAM_WIDTH = 16       # beams of one search (gpu_worker/features/beam_search.py)
# Every numeric field is bounded to a range whose arithmetic cannot overflow (a float64
# len ** length_penalty, a float32 logit / temperature or * penalty, seed + n), wide enough
# for any use people make of it; the error names the bound (core/faults.py is the backstop).
MAX_N = 1024              # sequences of one request (n, best_of); the servers' --max-n is lower
MAX_TEMPERATURE = 100.0   # OpenAI allows 2, vLLM any >= 0; past 100 the draw is uniform anyway
MIN_TEMPERATURE = 1e-4    # far below it fp32 logits / temperature reach inf (vLLM clamps to 1e-2)
MAX_TOP_K = 1 << 20       # past the largest vocabulary: the same as off
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGIT_BIAS = 100.0    # OpenAI's range, [-100, 100]
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: (2 ** 20 tokens) ** 10 = 2 ** 200, finite in float64
MIN_SEED, MAX_SEED = -2 ** 63, 2 ** 63 - 1 - MAX_N   # seed + i (one per sequence) stays an int64


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # top-k log-probabilities per generated token
    # top-k log-probabilities per prompt token (besides the token's own); the request's prompt
    # is then computed whole: a cached block has no logits to score its tokens with.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A structured_output.CompiledGrammar (GrammarCompiler.compile); None means free text.
    structured_output: Any = None
    # Beam search (gpu_worker/features/beam_search.py): best_of beams (n when not given) searched, the n
    # best returned, ranked with length_penalty.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0

    @property
    def beam_width(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first invalid field."""
        def bad(name: str, why: str):
            raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        def finite(name: str):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, "must be a finite number")

        def integer(name: str):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                bad(name, "must be an integer")

        integer("n")
        if not 1 <= self.n <= MAX_N:
            bad("n", f"must be in [1, {MAX_N}]")
        finite("temperature")
        if self.temperature != 0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
        finite("top_p")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        integer("top_k")
        if not -1 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be -1 (disabled) or in [0, {MAX_TOP_K}]")
        finite("min_p")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        finite("repetition_penalty")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            finite(name)
            if not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        for tok, bias in (self.logit_bias or {}).items():
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab_size:
                bad("logit_bias", f"token id {tok!r} is outside the vocabulary [0, {vocab_size})")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias) \
                    or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                bad("logit_bias", f"bias for token {tok} must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.seed is not None:
            integer("seed")
            if not MIN_SEED <= self.seed <= MAX_SEED:
                bad("seed", f"must be in [-2**63, 2**63 - 1 - {MAX_N}] (seed + n stays an int64)")
        integer("max_tokens")
        if self.max_tokens < 1:
            bad("max_tokens", "must be at least 1")
        integer("min_tokens")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings (got {len(self.stop)})")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(f"stop: each stop string must be 1 to {MAX_STOP_STRING_LEN} characters")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_STRINGS} ids (got {len(self.stop_token_ids)})")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: token id {t!r} is outside the vocabulary [0, {vocab_size})")
        if self.structured_output is not None and not hasattr(self.structured_output, "new_state"):
            raise ValueError("structured_output: must be a CompiledGrammar (GrammarCompiler.compile)")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name)
                if not 0 <= getattr(self, name) <= 20:
                    bad(name, "must be in [0, 20]")
        if self.best_of is not None:
            integer("best_of")
            if not self.n <= self.best_of <= MAX_N:
                bad("best_of", f"must be in [n ({self.n}), {MAX_N}]")
            if self.best_of > self.n and not self.use_beam_search:
                bad("best_of", "more candidates than n need use_beam_search (sampling returns all n)")
        if not isinstance(self.use_beam_search, bool):
            bad("use_beam_search", "must be true or false")
        finite("length_penalty")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            bad("length_penalty", f"must be in [{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            # It ranks finished beams; without beam search it would change nothing, silently.
            bad("length_penalty", f"only applies with use_beam_search (got {self.length_penalty:g})")
        if self.use_beam_search:
            self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        """Beam search ranks by log-probability: the sampling transforms would change what the
        beams are scored by, and stops end beams the search still ranks; refused by name."""
        width_field = "best_of" if self.best_of is not None else "n"
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"{width_field}: the beam width must be in [1, {MAX_BEAM_WIDTH}] with "
                             f"use_beam_search (got {self.beam_width})")
        defaults = SamplingParams()
        for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "min_tokens", "seed", "logprobs", "prompt_logprobs",
                     "structured_output"):
            value, default = getattr(self, name), getattr(defaults, name)
            if value != default and not (name == "top_k" and value == 0):
                raise ValueError(f"{name}: not allowed with use_beam_search (got {value!r})")
        if self.logit_bias:
            raise ValueError("logit_bias: not allowed with use_beam_search")
        if self.stop or self.stop_token_ids:
            raise ValueError(f"{'stop' if self.stop else 'stop_token_ids'}: not allowed with use_beam_search "
                             "(beams end at EOS or max_tokens)")
