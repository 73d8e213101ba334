"""Model configuration (read from a Hugging Face config.json, or a named preset)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from laps_jax.config_fields import ConfigError, Fields, parse_int, shown


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
    def from_hf_dict(cls, cfg: dict[str, Any],
                     where: str = "config.json") -> "RopeScaling | None":
        """From `rope_scaling` (Qwen2.5 model cards, transformers 4) or `rope_parameters`
        (transformers 5); None for plain RoPE. Anything laps_jax would compute differently
        from transformers is refused, naming the field and `where` (the file)."""
        top = Fields(cfg, where)
        scaling = cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ConfigError(f"{where}: rope_scaling must be an object or null, got "
                              f"{type(scaling).__name__}")
        key = "rope_scaling" if scaling else "rope_parameters"
        p = top.nested(key) or Fields({}, where)
        if any(isinstance(v, dict) for v in p.obj.values()):
            raise ConfigError(f"{where}: {key} must be one flat object (per-layer RoPE "
                              "settings are not supported)")
        kind = p.obj.get("rope_type") or p.obj.get("type") or "default"
        if kind not in ROPE_KINDS:
            raise ConfigError(f"{where}: {key}.rope_type: RoPE type {shown(kind)} is not "
                              f"supported (laps_jax implements {', '.join(ROPE_KINDS)})")
        partial = p.obj.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0) or isinstance(partial, bool):
            raise ConfigError(f"{where}: partial_rotary_factor={shown(partial)} is not "
                              "supported (Qwen2 rotates the whole head)")
        if kind == "default":
            return None
        factor = p.obj.get("factor")
        try:
            ok = (not isinstance(factor, bool) and isinstance(factor, (int, float))
                  and 0 < float(factor) < math.inf)
        except OverflowError:  # an integer too large for a float
            ok = False
        if not ok:
            raise ConfigError(f"{where}: {key}.factor: RoPE {kind} needs a positive 'factor', "
                              f"got {shown(factor)}")
        if kind == "linear":
            return cls("linear", float(factor))
        original = (p.integer("original_max_position_embeddings", None)
                    or top.integer("original_max_position_embeddings", None)
                    or top.integer("max_position_embeddings", 32768))
        return cls("yarn", float(factor), original,
                   p.number("beta_fast", 32.0, positive=False) or 32.0,  # 0 = default, as HF
                   p.number("beta_slow", 1.0, positive=False) or 1.0,
                   p.number("attention_factor", None), p.number("mscale", None, positive=False),
                   p.number("mscale_all_dim", None, positive=False), p.boolean("truncate", True))

    def to_hf_dict(self) -> dict[str, Any]:
        d = {"rope_type": self.kind, "factor": self.factor}
        if self.kind == "yarn":
            d.update(original_max_position_embeddings=self.original_max_positions,
                     beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                     attention_factor=self.attention_factor, mscale=self.mscale,
                     mscale_all_dim=self.mscale_all_dim, truncate=self.truncate)
        return {k: v for k, v in d.items() if v is not None}


LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(f: Fields, num_layers: int) -> list[str] | None:
    """`layer_types` when given: one known attention kind per layer (transformers refuses a
    list whose length is not num_hidden_layers, and so does laps_jax)."""
    types = f.obj.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise f.error("layer_types", f"must be a list of {' / '.join(LAYER_TYPES)}, got "
                                     f"{shown(types)}")
    if len(types) != num_layers:
        raise f.error("layer_types", f"has {len(types)} entries but num_hidden_layers is "
                                     f"{num_layers}")
    return types


def _check_supported(f: Fields, num_layers: int, max_positions: int) -> None:
    """Qwen2 options that would change the math: refused rather than silently ignored."""
    act = f.obj.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{f.where}: hidden_act {shown(act)} is not supported (Qwen2 uses "
                          "silu)")
    window = f.integer("sliding_window", None, minimum=0)
    use = f.boolean("use_sliding_window", False)
    first_sliding = f.integer("max_window_layers", 28, minimum=0)
    types = _layer_types(f, num_layers) or [
        "sliding_attention" if i >= first_sliding else "full_attention"
        for i in range(num_layers)]
    if use and window and window < max_positions and "sliding_attention" in types:
        raise ConfigError(f"{f.where}: sliding-window attention (use_sliding_window, "
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
    def from_hf_dict(cls, cfg: Any, name: str = "custom",
                     where: str = "config.json") -> "ModelConfig":
        """Reads a decoded config.json, checking every field's type, range and consistency;
        each error is one line naming the field and `where` (the file)."""
        f = Fields(cfg, where)
        model_type = cfg.get("model_type")
        if model_type not in ("qwen2",):
            raise ConfigError(f"{where}: unsupported model_type {shown(model_type)}: laps_jax "
                              "serves 'qwen2' (Qwen2 / Qwen2.5) checkpoints")
        heads, hidden = f.integer("num_attention_heads"), f.integer("hidden_size")
        layers = f.integer("num_hidden_layers")
        kv_heads = f.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise f.error("num_key_value_heads", f"({kv_heads}) must divide "
                                                 f"num_attention_heads ({heads})")
        if f.present("head_dim"):
            head_dim = f.integer("head_dim")
        elif hidden % heads:
            raise f.error("hidden_size", f"({hidden}) is not a multiple of num_attention_heads "
                                         f"({heads}); a config like this must set head_dim")
        else:
            head_dim = hidden // heads
        if head_dim % 2:
            raise f.error("head_dim", f"must be even (RoPE rotates pairs), got {head_dim}")
        if f.present("rope_theta"):
            theta = f.number("rope_theta")
        else:
            params = f.nested("rope_parameters")
            theta = params.number("rope_theta", 10000.0) if params else 10000.0
        max_positions = f.integer("max_position_embeddings", 32768)
        _check_supported(f, layers, max_positions)
        fields = dict(
            vocab_size=f.integer("vocab_size"), hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"), num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            tie_word_embeddings=f.boolean("tie_word_embeddings", False),
            max_position_embeddings=max_positions, name=name,
            rope_scaling=RopeScaling.from_hf_dict(cfg, where))
        try:
            return cls(**fields)
        except ConfigError as e:  # __post_init__'s checks, which name no file
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def from_model_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"{cfg_path}: missing file (a model directory needs config.json)")
        try:
            with open(cfg_path, "rb") as f:
                cfg = json.loads(f.read(), parse_int=parse_int)
        except OSError as e:
            raise ConfigError(f"{cfg_path}: cannot read ({e.strerror})") from None
        except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, 5,000-digit numbers
            raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(cfg, os.path.basename(os.path.normpath(path)), cfg_path)

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


BUILTIN = "builtin"  # the small checkpoint shipped in the package (docs/BUILTIN_MODEL.md)


def builtin_model_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_model")


def model_dir(spec: str) -> str:
    """'builtin' names the packaged checkpoint's directory; anything else is itself."""
    return builtin_model_dir() if spec == BUILTIN else spec


def resolve_model(spec: str) -> tuple[ModelConfig, str | None]:
    """A preset name gives (config, None); a directory or 'builtin' gives (config, dir)."""
    spec = model_dir(spec)
    if spec in PRESETS:
        return PRESETS[spec], None
    if os.path.isdir(spec):
        return ModelConfig.from_model_dir(spec), spec
    raise ConfigError(f"--model {spec!r} is neither a model directory, 'builtin' nor a preset "
                      f"(presets: {', '.join(sorted(PRESETS))})")


@dataclasses.dataclass
class EngineConfig:
    """How the engine lays out its KV cache and which shapes it compiles. `None` sizes follow
    the model (engine/settings.py makes them concrete, or refuses what cannot work)."""

    page_size: int = 16
    kv_cache_tokens: int = 65536      # capacity of the page pool, in tokens
    max_model_len: int | None = None  # prompt + output tokens of one sequence (None: the
                                      # model's context, or the KV pool if smaller)
    max_chunk: int | None = None      # largest prefill bucket, new tokens per sequence (None:
                                      # 2048, or max_model_len if shorter)
    min_chunk: int = 16               # smallest prefill bucket
    max_prefill_batch: int = 8        # sequences per prefill bucket
    max_decode_batch: int = 32        # sequences per decode bucket
    max_batch_tokens: int | None = None  # token budget of one prefill step (default max_chunk)
    attention_backend: str | None = None  # None = pallas on GPU, xla on CPU
    layer_loop: str | None = None         # None = unroll on CPU, scan on GPU (qwen2.LAYER_LOOPS)
    enable_prefix_cache: bool = True
    tensor_parallel: int = 1              # devices the weights and KV heads are split over

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.page_size + 1  # +1: page 0 is the trash page
