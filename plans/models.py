"""GPT-style model descriptions and the paper's GPT-3 sizes.

Global batches follow the GPT-3 paper's token budgets at sequence length 2048 (1.3B: 1M tokens,
6.7B/13B: 2M, 175B: 3.2M); the 70B entry uses 3.2M tokens as well (LLaMA-2 70B used 4M).
"""

from __future__ import annotations

from dataclasses import dataclass

from unicron.kernel.errors import InvalidRecord

#: The largest value of each field, far above any model trained (GPT-3 175B: 96 layers, hidden 12288,
#: 96 heads, 2048 tokens, 1536 sequences a step). They bound the throughput model's enumeration over
#: divisors (a global batch of 10**20 hung the coordinator's decision loop) and keep its arithmetic finite.
MODEL_LIMITS: dict[str, int] = {
    "layers": 4096,
    "hidden": 2**20,
    "heads": 2**20,
    "seq_len": 2**24,
    "vocab": 2**24,
    "global_batch": 2**20,
}


def _check_field(owner: str, field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidRecord(f"{owner}.{field}: expected a positive integer, got {value!r}")
    if value > MODEL_LIMITS[field]:
        raise InvalidRecord(f"{owner}.{field}: must be at most {MODEL_LIMITS[field]} (far above any real model)")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a GPT-style decoder and its training batch."""

    layers: int
    """Transformer layers."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads (must divide ``hidden``)."""
    seq_len: int
    """Sequence length s, tokens."""
    vocab: int
    """Vocabulary size V."""
    global_batch: int
    """Sequences per optimizer step B."""
    name: str = ""
    """Display name only; not used by the model."""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "seq_len", "vocab", "global_batch"):
            _check_field("model", field, getattr(self, field))
        if self.hidden % self.heads:
            raise InvalidRecord(f"model.heads: {self.heads} does not divide hidden={self.hidden}")

    @property
    def params(self) -> float:
        """Parameter count: 12·L·h² + 13·L·h per layer stack, plus token and position embeddings."""
        h, layers = self.hidden, self.layers
        return 12 * layers * h * h + 13 * layers * h + (self.vocab + self.seq_len) * h

    @property
    def flops_per_iteration(self) -> float:
        """Useful FLOPs of one step (forward + backward, no recomputation), Narayanan et al. 2021."""
        b, s, h, layers, v = self.global_batch, self.seq_len, self.hidden, self.layers, self.vocab
        return 72.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))

    @property
    def label(self) -> str:
        return self.name or f"L{self.layers}-h{self.hidden}"


def _gpt3(name: str, layers: int, hidden: int, heads: int, batch: int) -> ModelSpec:
    return ModelSpec(layers, hidden, heads, 2048, 51200, batch, name=name)


GPT3: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt3("1.3B", 24, 2048, 16, 512),
        _gpt3("7B", 32, 4096, 32, 1024),
        _gpt3("13B", 40, 5120, 40, 1024),
        _gpt3("70B", 80, 8192, 64, 1536),
        _gpt3("175B", 96, 12288, 96, 1536),
    )
}


def gpt3(name: str) -> ModelSpec:
    """A GPT-3 preset by size: ``"7B"``, ``"gpt3-7b"`` and ``"7b"`` all name the same model."""
    key = name.strip().upper().removeprefix("GPT3-").removeprefix("GPT-3-")
    if key not in GPT3:
        raise InvalidRecord(f"task.model: unknown preset {name!r}; known: {', '.join(GPT3)} or an object")
    return GPT3[key]
