"""Model configuration (read from a Hugging Face config.json, or a named preset)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


class ConfigError(ValueError):
    """A model directory or config.json that laps_jax cannot use."""


ROPE_KINDS = ("default", "linear", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A config.json's RoPE context extension (models/rope.py applies it); field names and
    defaults as transformers reads them."""

    kind: str                                 # "linear" or "yarn"
    factor: float                             # positions stretched this many times
    original_max_positions: int | None = None  # yarn: the pre-training context
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None     # yarn: None = derived from the factor
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS[1:] or not self.factor > 0:
            raise ConfigError(f"RoPE scaling needs a kind in {ROPE_KINDS[1:]} and a positive "
                              f"factor, got {self.kind!r} x {self.factor}")
        if self.kind == "yarn" and not (self.original_max_positions or 0) > 0:
            raise ConfigError("RoPE yarn needs original_max_position_embeddings > 0")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "RopeScaling | None":
        """From `rope_scaling` (Qwen2.5 model cards, transformers 4) or `rope_parameters`
        (transformers 5); None for plain RoPE. Anything laps_jax would compute differently
        from transformers is refused, naming the field."""
        scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
        if scaling is not None and not isinstance(scaling, dict):
            raise ConfigError(f"config.json: rope_scaling must be an object or null, got "
                              f"{type(scaling).__name__}")
        p = scaling or params or {}
        if not isinstance(p, dict) or any(isinstance(v, dict) for v in p.values()):
            raise ConfigError("config.json: rope_scaling / rope_parameters must be one object "
                              "(per-layer RoPE settings are not supported)")
        kind = p.get("rope_type") or p.get("type") or "default"
        if kind not in ROPE_KINDS:
            raise ConfigError(f"config.json: RoPE type {kind!r} is not supported (laps_jax "
                              f"implements {', '.join(ROPE_KINDS)})")
        partial = p.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"config.json: partial_rotary_factor={partial} is not supported "
                              "(Qwen2 rotates the whole head)")
        if kind == "default":
            return None
        factor = p.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ConfigError(f"config.json: RoPE {kind} needs a positive 'factor', got {factor!r}")
        if kind == "linear":
            return cls("linear", float(factor))
        original = p.get("original_max_position_embeddings",
                         cfg.get("original_max_position_embeddings",
                                 cfg.get("max_position_embeddings", 32768)))
        opt = lambda name: None if p.get(name) is None else float(p[name])
        return cls("yarn", float(factor), int(original),
                   float(p.get("beta_fast") or 32.0), float(p.get("beta_slow") or 1.0),
                   opt("attention_factor"), opt("mscale"), opt("mscale_all_dim"),
                   bool(p.get("truncate", True)))

    def to_hf_dict(self) -> dict[str, Any]:
        d = {"rope_type": self.kind, "factor": self.factor}
        if self.kind == "yarn":
            d.update(original_max_position_embeddings=self.original_max_positions,
                     beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                     attention_factor=self.attention_factor, mscale=self.mscale,
                     mscale_all_dim=self.mscale_all_dim, truncate=self.truncate)
        return {k: v for k, v in d.items() if v is not None}


def _check_supported(cfg: dict[str, Any], num_layers: int) -> None:
    """Qwen2 options that would change the math: refused rather than silently ignored."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported (Qwen2 uses silu)")
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") and window and window < cfg.get(
            "max_position_embeddings", 32768):
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)]
        if "sliding_attention" in types:
            raise ConfigError(f"config.json: sliding-window attention (use_sliding_window, "
                              f"window {window}) is not supported; laps_jax attends to the "
                              "whole context in every layer")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    name: str = "custom"
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"{field} must be positive, got {getattr(self, field)}")

    @property
    def max_context(self) -> int:
        """The longest sequence served: max_position_embeddings, or what a RoPE extension
        stretches the pre-training context to (Qwen2.5 with YaRN x4: 32768 -> 131072, the
        model cards' figure; their config.json keeps max_position_embeddings at 32768)."""
        sc = self.rope_scaling
        if sc is None:
            return self.max_position_embeddings
        return max(self.max_position_embeddings,
                   int((sc.original_max_positions or self.max_position_embeddings) * sc.factor))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count from shapes alone (matches the NNX model's abstract state)."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = (h * self.q_size + self.q_size + 2 * (h * self.kv_size + self.kv_size)
                     + self.q_size * h + 3 * h * i + 2 * h)
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + head + h

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.kv_size * itemsize

    def flops_per_token(self) -> float:
        """Dense matmul FLOPs per new token (2 x non-embedding params + lm_head)."""
        return 2.0 * (self.num_params() - self.vocab_size * self.hidden_size)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "custom") -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in ("qwen2",):
            raise ConfigError(f"unsupported model_type {model_type!r}: laps_jax serves 'qwen2' "
                              "(Qwen2 / Qwen2.5) checkpoints")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            _check_supported(cfg, int(cfg["num_hidden_layers"]))
            theta = cfg.get("rope_theta")
            if theta is None:
                theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rope_theta=float(theta),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                name=name,
                rope_scaling=RopeScaling.from_hf_dict(cfg),
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None

    @classmethod
    def from_model_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"{cfg_path}: missing file (a model directory needs config.json)")
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(cfg, name=os.path.basename(os.path.normpath(path)))

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            **({"rope_parameters": {"rope_theta": self.rope_theta,
                                    **self.rope_scaling.to_hf_dict()}}
               if self.rope_scaling else {}),
        }


PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": ModelConfig(151936, 896, 4864, 24, 14, 2, 64, 1e6, 1e-6, True, 32768,
                                "qwen2.5-0.5b"),
    "qwen2.5-7b": ModelConfig(152064, 3584, 18944, 28, 28, 4, 128, 1e6, 1e-6, False, 32768,
                              "qwen2.5-7b"),
    "qwen2.5-32b": ModelConfig(152064, 5120, 27648, 64, 40, 8, 128, 1e6, 1e-6, False, 32768,
                               "qwen2.5-32b"),
    # Small enough that tests compile and run in seconds.
    "tiny": ModelConfig(512, 64, 128, 2, 4, 2, 16, 10000.0, 1e-6, False, 4096, "tiny"),
    # Sized so a 2048-token float32 prefill takes about 1 s on the 2-core CI CPU.
    "bench-cpu": ModelConfig(8192, 384, 1024, 6, 6, 2, 64, 1e6, 1e-6, False, 8192, "bench-cpu"),
}


def resolve_model(spec: str) -> tuple[ModelConfig, str | None]:
    """A preset name gives (config, None); a directory gives (config, dir)."""
    if spec in PRESETS:
        return PRESETS[spec], None
    if os.path.isdir(spec):
        return ModelConfig.from_model_dir(spec), spec
    raise ConfigError(f"--model {spec!r} is neither a model directory nor a preset "
                      f"(presets: {', '.join(sorted(PRESETS))})")


@dataclasses.dataclass
class EngineConfig:
    """How the engine lays out its KV cache and which shapes it compiles."""

    page_size: int = 16
    kv_cache_tokens: int = 65536      # capacity of the page pool, in tokens
    max_model_len: int = 4096         # prompt + output tokens of one sequence
    max_chunk: int = 2048             # largest prefill bucket (new tokens per sequence)
    min_chunk: int = 16               # smallest prefill bucket
    max_prefill_batch: int = 8        # sequences per prefill bucket
    max_decode_batch: int = 32        # sequences per decode bucket
    max_batch_tokens: int | None = None  # token budget of one prefill step (default max_chunk)
    attention_backend: str | None = None  # None = pallas on GPU, xla on CPU
    layer_loop: str | None = None         # None = unroll on CPU, scan on GPU (qwen2.LAYER_LOOPS)
    enable_prefix_cache: bool = True
    # CPU: prefill buckets of at least this many tokens per row keep XLA's default dots or
    # oneDNN's, whichever ran faster at warm-up (engine/dot_tuning.py); 0 = never try oneDNN
    dot_tuning_tokens: int = 1024

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.page_size + 1  # +1: page 0 is the trash page
