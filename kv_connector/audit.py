"""A sampled check on what the states mean, against vLLM's own log-probabilities.

It rebuilds next-token log-probabilities from the last captured layer with the verifier's
own final norm and ``lm_head``. It compares them with vLLM's ``prompt_logprobs`` for the
same positions. Checksums cannot catch a wrong capture; this check can.

The last captured layer (id = the model's layer count) is the final decoder layer's output
before the norm. vLLM reports ``log_softmax(lm_head(norm(h[i - 1])))[token i]`` as prompt
token ``i``'s log-probability. A wrong layer, a shifted token, another request's rows or a
zeroed layer make the two disagree by far more than rounding, though every checksum
passes. In vLLM #50815 the mean error was 0.11, where a right capture gives 3e-9. Only
those two tensors are read from the model's safetensors. Pure torch and safetensors: no
vllm, nixl or sockets.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kv_connector.common.errors import ConfigurationError, IntegrityError

# of the rows: a wrong capture (a layer, a shift) is wrong in every row, so a few rows in
# ten thousand find it early; at this rate the audit costs under 1% of the consumer's CPU
# per row on an 8B-shaped head (``python -m scripts.bench.audit``)
DEFAULT_RATE = 1e-4
# a row
DEFAULT_POSITIONS = 4
# mean absolute log-probability error over a row's audited positions
DEFAULT_MAX_ERROR = 0.05
NORM_KEYS = ("model.norm.weight", "model.language_model.norm.weight")
HEAD_KEYS = ("lm_head.weight", "model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


class AuditError(ConfigurationError):
    """A model directory the audit cannot read, or a sample it does not apply to."""


class AuditFailed(IntegrityError, RuntimeError):
    """A sample's states do not give vLLM's log-probabilities: they are not what they say."""


@dataclass(frozen=True)
class AuditResult:
    """One audited sample: its positions, and the mean and max absolute difference of the
    log-probabilities rebuilt from its states and vLLM's."""

    positions: tuple[int, ...]
    mean_error: float
    max_error: float

    def passed(self, max_error: float = DEFAULT_MAX_ERROR) -> bool:
        return self.mean_error <= max_error


def audited(sample_id: str, rate: float) -> bool:
    """Whether the row ``sample_id`` is audited at ``rate``.

    Every process gives the same answer, a hash of the id and not a random draw. So the
    driver that asks vLLM for the log-probabilities and the consumer that checks them agree."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < rate * 2**64


def positions_of(num_tokens: int, count: int, seed: str) -> list[int]:
    """Up to ``count`` prompt positions to audit, chosen by ``seed``, the last always among them.

    They lie in 1..num_tokens-1, since position 0 has no log-probability."""
    if num_tokens < 2 or count < 1:
        return []
    rng = random.Random(seed)
    others = list(range(1, num_tokens - 1))
    picked = rng.sample(others, min(count - 1, len(others)))
    return sorted([*picked, num_tokens - 1])


def _tensors(model_dir: Path, keys: Sequence[Sequence[str]]) -> list[torch.Tensor]:
    """The first present name of each group of ``keys``, read from the model's
    safetensors shards (only those tensors)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        where: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        shards = sorted(model_dir.glob("*.safetensors"))
        if not shards:
            raise AuditError(f"no safetensors files in {model_dir}")
        where = {}
        for shard in shards:
            with safe_open(str(shard), "pt") as f:
                where.update({k: shard.name for k in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    out = []
    for group in keys:
        name = next((k for k in group if k in where), None)
        if name is None:
            raise AuditError(f"{model_dir} holds none of {list(group)}")
        with safe_open(str(model_dir / where[name]), "pt") as f:
            out.append(f.get_tensor(name))
    return out


class LogprobAudit:
    """The verifier's final RMSNorm and ``lm_head``, to rebuild next-token
    log-probabilities from the last captured layer's states."""

    def __init__(
        self, norm_weight: torch.Tensor, lm_head: torch.Tensor, eps: float, num_layers: int
    ) -> None:
        if lm_head.dim() != 2 or norm_weight.shape != (lm_head.shape[1],):
            raise AuditError(f"a norm of {tuple(norm_weight.shape)} and an lm_head of {tuple(lm_head.shape)}")
        self.norm_weight = norm_weight.float()
        # in the model's dtype, as vLLM multiplies (a bf16 8B head: 1 GB)
        self.lm_head = lm_head
        self.eps = eps
        self.num_layers = num_layers

    @classmethod
    def from_model(cls, model_dir: str | Path) -> LogprobAudit:
        """Read ``config.json`` and the two tensors from a Hugging Face model directory."""
        model_dir = Path(model_dir)
        try:
            config = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise AuditError(f"cannot read {model_dir / 'config.json'}: {e}") from None
        config = config.get("text_config", config)
        heads = HEAD_KEYS if config.get("tie_word_embeddings") else HEAD_KEYS[:1]
        norm, head = _tensors(model_dir, [NORM_KEYS, heads])
        return cls(norm, head, float(config.get("rms_norm_eps", 1e-6)), int(config["num_hidden_layers"]))

    def applies(self, layer_ids: Sequence[int]) -> bool:
        """Only where the last captured layer is the model's last decoder layer."""
        return bool(layer_ids) and layer_ids[-1] == self.num_layers

    def logprobs(self, states: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """``log_softmax(lm_head(norm(states)))`` at ``next_tokens``: [n] from [n, H].

        As vLLM does, the norm runs in fp32, the head in the model's dtype, the softmax in fp32."""
        h = states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        logits = (h.to(self.lm_head.dtype) @ self.lm_head.T).float()
        return torch.log_softmax(logits, dim=-1).gather(1, next_tokens.view(-1, 1)).view(-1)

    def check(
        self,
        token_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        layer_ids: Sequence[int],
        reference: Mapping[int, float],
    ) -> AuditResult:
        """Compare the log-probabilities the sample's last layer gives with vLLM's.

        ``reference`` maps a position to vLLM's log-probability of the prompt token there.
        ``hidden_states``: [T, L, H]. ``AuditError`` where the audit does not apply."""
        if not self.applies(layer_ids):
            raise AuditError(
                f"the last captured layer is {list(layer_ids)[-1:]}, not the model's last "
                f"({self.num_layers}): the audit applies only there"
            )
        positions = sorted(reference)
        n = int(token_ids.shape[0])
        if not positions or positions[0] < 1 or positions[-1] >= n:
            raise AuditError(f"positions {positions} are not prompt positions 1..{n - 1}")
        at = torch.tensor(positions)
        rebuilt = self.logprobs(hidden_states[at - 1, -1], token_ids[at].long())
        vllm = torch.tensor([reference[p] for p in positions], dtype=torch.float32)
        err = (rebuilt - vllm).abs()
        mean = float(err.mean())
        return AuditResult(tuple(positions), mean if math.isfinite(mean) else math.inf, float(err.max()))


PromptLogprobs = Sequence[Mapping[str, object] | None]


def reference_of(
    prompt_logprobs: PromptLogprobs, tokens: Sequence[int], positions: Sequence[int]
) -> dict[int, float]:
    """vLLM's log-probability of each prompt token at ``positions``, from its answer's ``prompt_logprobs``.

    Each position holds {token id: log-probability, or an object with a ``logprob``}; None
    at position 0. ``AuditError`` where a position is missing."""
    out: dict[int, float] = {}
    for p in positions:
        entry = prompt_logprobs[p] if p < len(prompt_logprobs) else None
        value = entry.get(str(tokens[p])) if entry is not None else None
        if isinstance(value, Mapping):
            value = value.get("logprob")
        if not isinstance(value, (int, float)):
            raise AuditError(f"vLLM's answer has no log-probability for token {tokens[p]} at position {p}")
        out[p] = float(value)
    return out


def states_of_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A sample file's token ids [T], states [T, L, H] and layer ids, as the reader CLI writes them.

    States of fp8 files are scaled back to float32."""

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        states = f.get_tensor("hidden_states")
        if "hidden_states_scales" in f.keys():  # noqa: SIM118 - safe_open has no __contains__
            states = states.float() * f.get_tensor("hidden_states_scales").float()
        token_ids = f.get_tensor("token_ids")
    layer_ids = [int(i) for i in meta.get("layer_ids", "").split(",") if i]
    return token_ids, states, layer_ids


@dataclass(frozen=True)
class RowAudit:
    """The audit as a data-generation run applies it: which rows (``rate``), how many
    positions each, and the largest mean error that passes."""

    audit: LogprobAudit
    rate: float = DEFAULT_RATE
    positions: int = DEFAULT_POSITIONS
    max_error: float = DEFAULT_MAX_ERROR

    def wants(self, sample_id: str) -> bool:
        return audited(sample_id, self.rate)

    def check_file(self, path: str | Path, sample_id: str, prompt_logprobs: PromptLogprobs) -> AuditResult:
        """The audit of a sample's file against vLLM's answer for its row."""
        token_ids, states, layer_ids = states_of_file(path)
        tokens = [int(t) for t in token_ids.tolist()]
        ref = reference_of(prompt_logprobs, tokens, positions_of(len(tokens), self.positions, sample_id))
        return self.audit.check(token_ids, states, layer_ids, ref)
