"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.errors import InvalidRequestError

# Temperatures below this are treated as greedy decoding.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
"""OpenAI's limit on logit_bias entries."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults match OpenAI's API.

    `max_tokens=None` means "until EOS or the model's context is full"; `max_tokens=0` only
    computes the prompt (for its `prompt_logprobs`).
    `logprobs=N` returns the log-probability of each sampled token and the top N
    alternatives, computed from the model's raw distribution (before temperature and
    penalties), as vLLM does.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    """The log-probability of each prompt token after the first, given the tokens before
    it, with the top N alternatives (0: the token's own only). The prompt is then computed
    whole, never read from the prefix cache (cached blocks hold KV, not logits)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, each bias added to its token's logit before the pick (after
    the penalties; logprobs stay the model's own), as OpenAI and vLLM do."""
    grammar: str | None = None
    """An llguidance grammar (`pdserve.structured.grammar_for`: a JSON schema, regex, choice
    or Lark grammar) every output token must keep to; None: unconstrained."""
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept a single string or any iterable for the tuple fields.
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        object.__setattr__(self, "logit_bias", bias)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (1 <= self.n <= 128, "n", "must be between 1 and 128"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 or -1 disables it)"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens", "must be >= 0"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be between 0 and {MAX_LOGPROBS}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (len(self.stop) <= 16, "stop", "at most 16 stop strings"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be non-negative integers",
            ),
            (
                all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
                "logit_bias",
                "must map token ids to biases in [-100, 100]",
            ),
            (
                len(self.logit_bias) <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"takes at most {MAX_LOGIT_BIAS} tokens",
            ),
            (
                self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
                "seed",
                "must be an integer in [0, 2**63)",
            ),
        ]
        if self.max_tokens is not None:
            checks.append((self.min_tokens <= self.max_tokens, "min_tokens", "exceeds max_tokens"))
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {message}", param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
